"""Prompt log-probabilities: every prompt token after the first scored under the logits at the
position before it (the raw logits' log_softmax, as the output tokens'), equal to transformers';
which rows a pass scores when its prompt is cut in chunks or partly cached; the validation."""

from __future__ import annotations

import pytest

from reference import assert_prompt_logprobs_match, engine_model, engine_tokenizer
from s02_request_and_sampling.engine import generate
from s02_request_and_sampling.prompt_logprobs import prompt_logprob_rows
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams


def test_prompt_logprobs_equal_transformers(tiny_model_dir):
    """Requests with prompt_logprobs 3, 0 and none in one run: the first two get one entry per
    prompt token (None for the first), each transformers' log_softmax at the position before it
    with its k likeliest tokens; the third gets None. A one-token prompt has only the None."""
    tok, model = engine_tokenizer(str(tiny_model_dir)), engine_model(str(tiny_model_dir))
    prompts = [tok.encode_prompt("Score this sentence, please."), [5, 9, 77, 31], tok.encode_prompt("Hi"), [42]]
    params = [
        SamplingParams(temperature=0.8, seed=3, max_new_tokens=4, prompt_logprobs=3, logprobs=1),
        SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=0),
        SamplingParams(temperature=0, max_new_tokens=2),
        SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=2),
    ]
    outs = generate(model, tok, prompts, params)
    for i in (0, 1):
        what = f"{tiny_model_dir.name}, request {i} (prompt_logprobs={params[i].prompt_logprobs})"
        assert_prompt_logprobs_match(tiny_model_dir, prompts[i], outs[i], params[i].prompt_logprobs, what)
    assert outs[2].prompt_logprobs is None, (
        f"a request without prompt_logprobs gets prompt_logprobs=None, got {outs[2].prompt_logprobs!r}"
    )
    assert outs[3].prompt_logprobs == [None], (
        f"a one-token prompt has one entry, None (nothing precedes its token), got {outs[3].prompt_logprobs!r}"
    )
    assert outs[0].logprobs is not None and len(outs[0].logprobs) == len(outs[0].output_ids), (
        "prompt_logprobs and logprobs are asked for independently: request 0 asked for both"
    )


def test_scoring_does_not_change_the_tokens(tiny_models_root):
    """The same greedy request with and without prompt_logprobs: the same output tokens."""
    path = tiny_models_root / "qwen2"
    tok, model = engine_tokenizer(str(path)), engine_model(str(path))
    plain, scored = generate(
        model,
        tok,
        ["Once upon a time"] * 2,
        [
            SamplingParams(temperature=0, max_new_tokens=6),
            SamplingParams(temperature=0, max_new_tokens=6, prompt_logprobs=1),
        ],
    )
    assert scored.output_ids == plain.output_ids, (
        f"prompt_logprobs only reads more rows of the same pass: the tokens must not change ({plain.output_ids} "
        f"without, {scored.output_ids} with)"
    )


def make_req(prompt_len: int, k: int | None, cached_len: int, device_len: int, scored: int = 0) -> Req:
    req = Req("r", list(range(100, 100 + prompt_len)), SamplingParams(prompt_logprobs=k))
    req.cached_len, req.device_len = cached_len, device_len
    req.scored_len = scored
    return req


def test_rows_of_a_mixed_pass():
    """One ragged pass: a decode (1 token), a whole 5-token prompt that asked, a request that did
    not, then the first chunk (positions 0..2) of a 6-token prompt that asked: the rows are each
    scored position's place in the pass, and each scores the prompt token after it."""
    decode = make_req(4, 1, cached_len=4, device_len=5, scored=3)
    whole = make_req(5, 2, cached_len=0, device_len=5)
    silent = make_req(3, None, cached_len=0, device_len=3)
    chunk = make_req(6, 0, cached_len=0, device_len=3)
    plan = prompt_logprob_rows([decode, whole, silent, chunk])
    # the pass: decode at row 0, whole at rows 1..5, silent at 6..8, chunk at 9..11
    assert plan.rows == [1, 2, 3, 4, 9, 10, 11], (
        f"rows scored: the whole prompt's positions 0..3 (rows 1..4; position 4 scores the first output token) and "
        f"the chunk's positions 0..2 (rows 9..11); got {plan.rows}"
    )
    assert plan.token_ids == [101, 102, 103, 104, 101, 102, 103], (
        f"each row scores the prompt token after its position; got {plan.token_ids}"
    )
    assert plan.reqs == [whole] * 4 + [chunk] * 3 and plan.num_reqs == 4, "each row belongs to its request"
    assert plan.top_ks == [2] * 4 + [0] * 3, f"each row asks its request's prompt_logprobs, got {plan.top_ks}"
    assert (whole.scored_len, chunk.scored_len, decode.scored_len) == (4, 3, 3), (
        "scored_len moves past the positions a pass scores (the next chunk starts there): expected 4, 3 and 3 "
        f"(unchanged for the decode), got {(whole.scored_len, chunk.scored_len, decode.scored_len)}"
    )


def test_rows_of_a_later_chunk_and_a_recomputed_prefix():
    """The chunk after positions 0..2 were scored scores 3..4 (5 is the last, it scores an output);
    a request that computes positions it already scored (after a retraction) scores only the new ones."""
    next_chunk = make_req(6, 1, cached_len=3, device_len=6, scored=3)
    plan = prompt_logprob_rows([next_chunk])
    assert plan.rows == [0, 1] and plan.token_ids == [104, 105], (
        f"the second chunk (positions 3..5) scores positions 3 and 4, rows 0 and 1 of the pass; got rows "
        f"{plan.rows} scoring {plan.token_ids}"
    )
    again = make_req(6, 1, cached_len=1, device_len=6, scored=4)
    plan = prompt_logprob_rows([again])
    assert plan.rows == [3] and plan.token_ids == [105], (
        f"positions 0..3 were scored before: only position 4 (row 3 of a pass starting at position 1); got "
        f"{plan.rows} scoring {plan.token_ids}"
    )


def test_a_cached_unscored_prefix_is_refused():
    """A request whose prompt came from the prefix cache beyond the positions it scored would have
    no logits for them: an error naming max_prefix_len, never a silent gap."""
    with pytest.raises(RuntimeError, match="max_prefix_len"):
        prompt_logprob_rows([make_req(8, 1, cached_len=5, device_len=8, scored=2)])


def test_max_prefix_len():
    """What a prefix cache may give a request: all but its last token, and while it still scores
    its prompt, only the positions it scored."""
    plain = make_req(8, None, cached_len=0, device_len=8)
    assert plain.max_prefix_len == 7, f"all but the last token: 7 of 8, got {plain.max_prefix_len}"
    scoring = make_req(8, 1, cached_len=0, device_len=8, scored=2)
    assert scoring.max_prefix_len == 2, (
        f"a request that scored positions 0..1 of its prompt may take only those from the cache, got "
        f"{scoring.max_prefix_len}"
    )
    done = make_req(8, 1, cached_len=0, device_len=8, scored=7)
    done.output_ids = [1, 2]
    assert done.max_prefix_len == 9, (
        f"a request whose prompt is scored (7 positions) may take everything but its last token (9 of 10) after a "
        f"retraction, got {done.max_prefix_len}"
    )


def test_prompt_logprobs_range():
    """Off by default; 0..20 alternatives, as logprobs (test_sampling_params.py refuses the rest)."""
    assert SamplingParams().prompt_logprobs is None, "prompt_logprobs is off by default"
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
