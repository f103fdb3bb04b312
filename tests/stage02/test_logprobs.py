"""Log-probabilities: each output token's log-probability under the model's own distribution (the
raw logits' log_softmax, before temperature and the filters), and the k likeliest tokens at its
place; checked on crafted logits and against transformers, greedy and sampled."""

from __future__ import annotations

import math

import pytest
import torch

from reference import assert_logprobs_match, engine_model, engine_tokenizer
from s02_request_and_sampling.engine import generate
from s02_request_and_sampling.logprobs import token_logprobs
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams


def req(logprobs: int | None, temperature: float = 1.0) -> Req:
    return Req("r", [1], SamplingParams(logprobs=logprobs, temperature=temperature))


def test_crafted_rows():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0], [5.0, 4.0, 3.0, 2.0]])
    got = token_logprobs(logits, torch.tensor([1, 2, 0]), [req(2), req(None), req(0)])
    expected = torch.log_softmax(logits, dim=-1)
    assert got[1] is None, f"a request with logprobs=None asked for nothing, but got {got[1]}"
    first, third = got[0], got[2]
    assert first is not None and third is not None, "the requests with logprobs=2 and logprobs=0 got None"
    assert first.token_id == 1 and math.isclose(first.logprob, expected[0, 1].item(), abs_tol=1e-6), (
        f"row 0 sampled token 1: its logprob is log_softmax(logits)[0, 1] = {expected[0, 1].item():.6f}, got "
        f"token {first.token_id} with {first.logprob:.6f}"
    )
    assert [t for t, _ in first.top] == [0, 1], (
        f"logprobs=2: the top entries are the 2 likeliest tokens, most likely first ([0, 1]); got {first.top}"
    )
    assert all(math.isclose(v, expected[0, t].item(), abs_tol=1e-6) for t, v in first.top), (
        f"the top entries carry each token's log_softmax value {expected[0, :2].tolist()}, got {first.top}"
    )
    assert third.top == () and math.isclose(third.logprob, expected[2, 0].item(), abs_tol=1e-6), (
        f"logprobs=0: the sampled token's own logprob ({expected[2, 0].item():.6f}) and no alternatives; got {third}"
    )


def test_the_distribution_is_the_models_own_not_the_temperatures():
    """The same logits under temperature 0.3 and 2.0: the same logprob (it describes the model, not the draw)."""
    logits = torch.tensor([[3.0, 1.0, 0.5, 0.0]])
    expected = torch.log_softmax(logits, dim=-1)[0, 0].item()
    for temperature in (0.3, 2.0):
        [entry] = token_logprobs(logits, torch.tensor([0]), [req(1, temperature)])
        assert entry is not None and math.isclose(entry.logprob, expected, abs_tol=1e-6), (
            f"at temperature {temperature} the logprob of token 0 should still be the raw logits' log_softmax "
            f"{expected:.6f} (the model's distribution), got {entry.logprob if entry else None}"
        )


def test_half_precision_logits_are_read_in_float32():
    """bfloat16 logits: the log_softmax is taken in float32. In bfloat16 (8 bits of mantissa) the
    likeliest token's log-probability here rounds to 0.0 and token 1's is off by 0.03."""
    logits = torch.tensor([[10.3, 0.1, -5.7, 3.3]], dtype=torch.bfloat16)
    expected = torch.log_softmax(logits.float(), dim=-1)[0]
    for token in (0, 1):
        [entry] = token_logprobs(logits, torch.tensor([token]), [req(0)])
        assert entry is not None and abs(entry.logprob - expected[token].item()) < 1e-4, (
            f"token {token}'s logprob from bfloat16 logits is {expected[token].item():.5f} in float32; got "
            f"{entry.logprob if entry else None} (take the log_softmax in float32: logits.float())"
        )


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_generate_matches_transformers(tiny_model_dir, temperature):
    path = str(tiny_model_dir)
    model, tokenizer = engine_model(path), engine_tokenizer(path)
    prompts = ["Tell me a story.", "2 + 2 ="]
    params = [
        SamplingParams(temperature=temperature, max_new_tokens=8, ignore_eos=True, seed=3, logprobs=3),
        SamplingParams(temperature=temperature, max_new_tokens=8, ignore_eos=True, seed=4),
    ]
    asked, not_asked = generate(model, tokenizer, prompts, params)
    assert not_asked.logprobs is None, f"a request without logprobs gets logprobs=None, got {not_asked.logprobs!r}"
    what = f"{tiny_model_dir.name}, temperature {temperature}"
    assert_logprobs_match(path, tokenizer.encode_prompt(prompts[0]), asked, 3, what)
