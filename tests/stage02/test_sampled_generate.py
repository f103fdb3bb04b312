"""The engine end to end: seeds reproduce, requests do not disturb each other, stop strings
that span tokens stop a real model's generation, and greedy still matches transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy
from s02_request_and_sampling.engine import generate
from s02_request_and_sampling.req import FinishReason
from s02_request_and_sampling.sampling_params import SamplingParams

PROMPT = "Tell me a story."


@pytest.fixture(scope="module")
def tiny(tiny_models_root) -> Path:
    """One tiny model is enough here: sampling and stopping do not depend on the architecture."""
    return tiny_models_root / "llama"


def model_and_tokenizer(path: Path):
    return engine_model(str(path)), engine_tokenizer(str(path))


def test_greedy_matches_transformers(tiny_model_dir):
    model, tokenizer = model_and_tokenizer(tiny_model_dir)
    prompt_ids = tokenizer.encode_prompt(PROMPT)
    [out] = generate(model, tokenizer, [PROMPT], SamplingParams(temperature=0.0, max_new_tokens=12))
    expected = hf_greedy(tiny_model_dir, prompt_ids, 12, tokenizer.eos_token_ids)
    assert_same_tokens(out.output_ids, expected, f"greedy generate on the tiny {tiny_model_dir.name} model", tokenizer)


def test_outputs_report_counts_and_finish_reason(tiny):
    model, tokenizer = model_and_tokenizer(tiny)
    outs = generate(
        model,
        tokenizer,
        [PROMPT, [1, 2, 3]],
        SamplingParams(temperature=0.7, max_new_tokens=5, ignore_eos=True, seed=0),
    )
    for out, prompt_len, what in zip(
        outs, [len(tokenizer.encode_prompt(PROMPT)), 3], ["a text prompt", "token ids [1, 2, 3]"]
    ):
        assert out.finish_reason == FinishReason("length"), (
            f"{what}: 5 tokens with ignore_eos must finish with 'length', got {out.finish_reason}"
        )
        assert (out.prompt_tokens, out.output_tokens, len(out.output_ids)) == (prompt_len, 5, 5), (
            f"{what}: expected prompt_tokens={prompt_len}, output_tokens=5, got {out.prompt_tokens}, "
            f"{out.output_tokens} "
            f"({len(out.output_ids)} output_ids)"
        )
        assert out.text == tokenizer.decode(out.output_ids), f"{what}: text should be the decoded output_ids"


def test_same_seed_reproduces_and_different_seeds_differ(tiny):
    model, tokenizer = model_and_tokenizer(tiny)

    def params(seed):
        return SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=seed)

    outs = generate(model, tokenizer, [PROMPT] * 4, [params(5), params(6), params(5), params(7)])
    ids = [o.output_ids for o in outs]
    assert ids[0] == ids[2], f"two requests with seed=5 in one batch gave different continuations:\n{ids[0]}\n{ids[2]}"
    assert len({tuple(ids[0]), tuple(ids[1]), tuple(ids[3])}) == 3, (
        f"seeds 5, 6 and 7 should give different continuations, got:\n{ids[0]}\n{ids[1]}\n{ids[3]}"
    )
    [alone] = generate(model, tokenizer, [PROMPT], params(5))
    assert_same_tokens(
        alone.output_ids,
        ids[0],
        "seed=5 alone vs seed=5 inside a batch of 4 (a request's tokens must depend only on its seed and its own "
        "row of logits: softmax and filters work along the vocabulary, dim=-1)",
    )
    [unseeded] = generate(model, tokenizer, [PROMPT], params(None))
    [replay] = generate(model, tokenizer, [PROMPT], params(unseeded.seed))
    assert_same_tokens(
        replay.output_ids, unseeded.output_ids, f"an unseeded run replayed with its recorded seed {unseeded.seed}"
    )


def first_stop_after(ids: list[int], stop: str, decode) -> int:
    """Index of the token whose arrival first makes ``stop`` appear in the decoded text."""
    return next(j for j in range(len(ids)) if stop in decode(ids[: j + 1]))


def check_stop_string_run(model, tokenizer, stop: str, greedy_ids: list[int], max_new_tokens: int):
    at = first_stop_after(greedy_ids, stop, tokenizer.decode)
    full = tokenizer.decode(greedy_ids[: at + 1])
    expected_text = full[: full.index(stop)]
    [out] = generate(
        model,
        tokenizer,
        [PROMPT],
        SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, stop=[stop]),
    )
    assert out.finish_reason == FinishReason("stop", stop), (
        f"the greedy continuation {full!r} contains the stop string {stop!r} (completed by token {at}), so generation "
        f"should finish with FinishReason('stop', {stop!r}); got {out.finish_reason} after {len(out.output_ids)} tokens"
    )
    assert_same_tokens(
        out.output_ids,
        greedy_ids[: at + 1],
        f"greedy run with stop={stop!r} (should end with the token that completes it)",
        tokenizer,
    )
    assert out.text == expected_text, (
        f"the text should be trimmed to end before {stop!r}: expected {expected_text!r}, got {out.text!r}"
    )


def test_stop_string_spanning_tokens_stops_generation(tiny):
    model, tokenizer = model_and_tokenizer(tiny)
    [plain] = generate(model, tokenizer, [PROMPT], SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    g = plain.output_ids

    # The byte-level tokenizer makes every character a token of its own, so a run of printable
    # ASCII tokens gives a stop string that spans token boundaries (3 tokens if there is such a
    # run, else 2; control characters as a last resort).
    def runs(length, ok):
        return [i for i in range(2, len(g) - length + 1) if all(ok(t) for t in g[i : i + length])]

    starts = [
        (i, n)
        for n, ok in [(3, range(32, 127).__contains__), (2, range(32, 127).__contains__), (2, range(128).__contains__)]
        for i in runs(n, ok)
    ]
    assert starts, (
        f"test setup: the tiny model's greedy output {g} has no two ASCII tokens in a row to use as a stop string"
    )
    i, n = starts[0]
    check_stop_string_run(model, tokenizer, bytes(g[i : i + n]).decode(), g, 24)


def test_default_model_stop_string_and_seed(default_model_dir):
    model, tokenizer = model_and_tokenizer(default_model_dir)
    [plain] = generate(model, tokenizer, [PROMPT], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    g = plain.output_ids
    # A stop string made of the last 2 characters of token 3's text and the first of token 4's.
    before, after = tokenizer.decode(g[:4]), tokenizer.decode(g[:5])
    assert len(before) >= 2 and after.startswith(before) and len(after) > len(before), (
        f"test setup: unusable continuation {g}"
    )
    check_stop_string_run(model, tokenizer, before[-2:] + after[len(before)], g, 8)

    params = SamplingParams(temperature=0.8, max_new_tokens=6, seed=11)
    first, second = generate(model, tokenizer, [PROMPT, PROMPT], params)
    assert_same_tokens(second.output_ids, first.output_ids, "two requests with seed=11 on the default model", tokenizer)
