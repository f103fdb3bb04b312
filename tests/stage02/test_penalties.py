"""Penalties, logit_bias and min_new_tokens: each request's history reshapes its logits before the
draw, checked on crafted logits (each formula, the asymmetry of the repetition penalty, the
output-only counts, the ban on ending early) and against transformers' repetition penalty,
sequence bias and minimum length, with OpenAI's frequency and presence penalties as documented,
on every tiny family."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy, hf_penalized_greedy
from s02_request_and_sampling.engine import generate
from s02_request_and_sampling.penalties import apply_penalties, count_sampled
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampler import sample_with_penalties
from s02_request_and_sampling.sampling_params import SamplingParams

PROMPT_IDS = [3, 3]  # token 3 is in the prompt; outputs below are counted with count_sampled


def req(output: Sequence[int] = (), **penalties) -> Req:
    """A request whose sampler already drew ``output`` (its penalty counts hold them)."""
    r = Req("r", PROMPT_IDS, SamplingParams(**penalties))
    apply_penalties(torch.zeros(1, 8), [r])  # its first draw makes its state
    for token in output:
        count_sampled([r], torch.tensor([token]))
    return r


LOGITS = torch.tensor([[2.0, -2.0, 1.0, 4.0, -1.0, 0.5, 3.0, 0.0]])


def changed(r: Req) -> torch.Tensor:
    got = apply_penalties(LOGITS, [r])
    assert got is not LOGITS and torch.equal(LOGITS, torch.tensor([[2.0, -2.0, 1.0, 4.0, -1.0, 0.5, 3.0, 0.0]])), (
        "apply_penalties must return a new tensor and leave the logits it was given as they are (the "
        "log-probabilities are read from them: they stay the model's own)"
    )
    return got[0]


def test_repetition_divides_positive_and_multiplies_negative_logits():
    """r = 1.6 on tokens 3 (prompt, logit 4), 1 (output, -2), 4 (output twice, -1): each becomes less
    likely: 4 -> 2.5, -2 -> -3.2, -1 -> -1.6; tokens never seen keep their logits. (Not a whole
    number: a penalty that reached the device as an integer would still pass with 2.)"""
    got = changed(req([1, 4, 4], repetition_penalty=1.6))
    expected = torch.tensor([2.0, -3.2, 1.0, 2.5, -1.6, 0.5, 3.0, 0.0])
    assert torch.allclose(got, expected), (
        f"repetition_penalty=1.6 with token 3 in the prompt and tokens 1, 4 in the output: a positive logit is "
        f"divided by 1.6 and a NEGATIVE one multiplied by 1.6 (dividing it would make a repeat more likely); "
        f"expected {expected.tolist()}, got {got.tolist()} (a float setting stays a float on the device: "
        "host_to_device(values, device, torch.float32))"
    )


def test_frequency_counts_every_occurrence_in_the_output_only():
    got = changed(req([1, 4, 4, 4], frequency_penalty=0.5))
    expected = LOGITS[0] - 0.5 * torch.tensor([0, 1, 0, 0, 3, 0, 0, 0])
    assert torch.allclose(got, expected), (
        f"frequency_penalty=0.5 with output [1, 4, 4, 4]: logit - 0.5 * count in the OUTPUT (token 3 is only in "
        f"the prompt and is not penalised); expected {expected.tolist()}, got {got.tolist()}"
    )


def test_presence_counts_once_and_negative_values_encourage():
    got = changed(req([1, 4, 4, 4], presence_penalty=-1.5))
    expected = LOGITS[0] + 1.5 * torch.tensor([0, 1, 0, 0, 1, 0, 0, 0])
    assert torch.allclose(got, expected), (
        f"presence_penalty=-1.5 with output [1, 4, 4, 4]: logit - (-1.5) once per token present in the output, "
        f"however often; expected {expected.tolist()}, got {got.tolist()}"
    )


def test_logit_bias_adds_per_token_after_the_penalties():
    got = changed(req([3], repetition_penalty=2.0, logit_bias={3: 10.0, 7: -100.0}))
    expected = LOGITS[0].clone()
    expected[3], expected[7] = 4.0 / 2 + 10.0, -100.0
    assert torch.allclose(got, expected), (
        f"repetition_penalty=2 then logit_bias {{3: 10, 7: -100}}: token 3 becomes 4 / 2 + 10 = 12 (the bias is "
        f"added after the penalty), token 7 becomes -100; expected {expected.tolist()}, got {got.tolist()}"
    )


def test_only_the_penalised_rows_change():
    plain = Req("p", PROMPT_IDS, SamplingParams())
    penalised = req([0], frequency_penalty=1.0)
    logits = torch.cat([LOGITS, LOGITS])
    got = apply_penalties(logits, [plain, penalised])
    assert torch.equal(got[0], LOGITS[0]), f"a request without penalties keeps its row, got {got[0].tolist()}"
    assert got[1, 0].item() == pytest.approx(1.0), f"row 1 has frequency_penalty=1 on token 0: 2 - 1, got {got[1, 0]}"
    assert apply_penalties(logits, [plain, plain]) is logits, "without any penalties the logits come back untouched"


def test_greedy_picks_the_best_penalised_token_and_counts_what_it_drew():
    """Token 3 is the argmax; a presence penalty of 2 after it was drawn once moves greedy to token 6."""
    r = Req("g", [0], SamplingParams(temperature=0, presence_penalty=2.0))
    first = sample_with_penalties(LOGITS, [r]).item()
    second = sample_with_penalties(LOGITS, [r]).item()
    assert (first, second) == (3, 6), (
        f"greedy with presence_penalty=2: the first draw takes token 3 (logit 4), which then counts as present "
        f"(4 - 2 = 2 < 3), so the second takes token 6; got {first} then {second}"
    )


@pytest.mark.parametrize(
    "penalties",
    [
        dict(repetition_penalty=1.5),
        dict(frequency_penalty=1.2, presence_penalty=0.6),
        dict(frequency_penalty=-1.0, presence_penalty=-2.0),
        dict(repetition_penalty=1.3, presence_penalty=-0.5, logit_bias={65: 5.0, 101: -100.0}),
    ],
    ids=["repetition", "frequency+presence", "encouraged-repeats", "all"],
)
def test_greedy_with_penalties_matches_transformers(tiny_model_dir, penalties):
    model, tokenizer = engine_model(str(tiny_model_dir)), engine_tokenizer(str(tiny_model_dir))
    prompt = tokenizer.encode_prompt("Once upon a time, once upon a time")
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, **penalties)
    [out] = generate(model, tokenizer, [prompt], params)
    expected = hf_penalized_greedy(tiny_model_dir, prompt, 24, params)
    assert_same_tokens(
        out.output_ids, expected, f"greedy with {penalties} on the tiny {tiny_model_dir.name}", tokenizer
    )
    [plain] = generate(model, tokenizer, [prompt], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    assert plain.output_ids != out.output_ids, (
        f"{penalties} should change what the tiny {tiny_model_dir.name} model repeats, but the output is the same as "
        f"without penalties: {plain.output_ids}"
    )


@pytest.mark.parametrize("ignore_eos,expected", [(False, [0, 0, 3]), (True, [6, 6, 3])], ids=["eos", "ignore_eos"])
def test_min_new_tokens_bans_the_ending_tokens_until_enough_are_out(ignore_eos, expected):
    """Token 3 is a stop token pushed up by +50 and token 6 (second best) is EOS: for the first two
    draws both are banned (the bias cannot lift the ban; EOS only while it would end the request),
    at the third the stop token wins."""
    params = SamplingParams(
        temperature=0, min_new_tokens=2, stop_token_ids=[3], logit_bias={3: 50.0}, ignore_eos=ignore_eos
    )
    r = Req("m", [0], params, eos_token_ids=[6])
    got = [sample_with_penalties(LOGITS, [r]).item() for _ in expected]
    assert got == expected, (
        f"min_new_tokens=2, stop_token_ids=[3] (with logit_bias +50), EOS 6, ignore_eos={ignore_eos}: the first "
        f"two draws may not be a token that ends the request (3, and 6 unless ignore_eos), whatever the bias; "
        f"the third may; expected {expected}, got {got}. Count the draws with the request's PenaltyState.drawn: "
        "this test draws without appending to output_ids, and stage 10's overlap samples before it appends"
    )


def test_greedy_with_min_new_tokens_matches_transformers(tiny_model_dir):
    """The plain greedy output's first three tokens become stop tokens: plain, the request ends at
    once; with min_new_tokens=8 it may not end before 8 tokens, as transformers' min_new_tokens."""
    model, tokenizer = engine_model(str(tiny_model_dir)), engine_tokenizer(str(tiny_model_dir))
    prompt = tokenizer.encode_prompt("Once upon a time, once upon a time")
    [plain] = generate(model, tokenizer, [prompt], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    stops = sorted(set(plain.output_ids[:3]))
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop_token_ids=stops, min_new_tokens=8)
    [out] = generate(model, tokenizer, [prompt], params)
    expected = hf_greedy(tiny_model_dir, prompt, 24, eos=stops, min_new_tokens=8)
    assert_same_tokens(
        out.output_ids,
        expected,
        f"greedy, stop_token_ids={stops}, min_new_tokens=8, ignore_eos=True (only those ids end it) on the tiny "
        f"{tiny_model_dir.name}",
        tokenizer,
    )
    assert len(out.output_ids) > 8 and not set(out.output_ids[:8]) & set(stops), (
        f"min_new_tokens=8: none of the first 8 tokens may be a stop token {stops}, got {out.output_ids}"
    )
