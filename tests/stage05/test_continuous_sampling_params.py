"""Stage 5 (graded): every request in a continuous batch follows its own SamplingParams - its
temperature and filters, its seed, its stop tokens and strings, its max_new_tokens - exactly as
if it ran alone."""

from __future__ import annotations

import prompt_logprob_cases as scored
from continuous_helpers import assert_pool_free, retraction_workload, tiny_engine
from penalty_cases import assert_penalties_like_stage3, penalised_params
from reference import (
    assert_logprobs_match,
    assert_prompt_logprobs_match,
    assert_same_tokens,
    engine_model,
    engine_tokenizer,
)
from s02_request_and_sampling.sampling_params import SamplingParams
from s03_kv_cache.engine import generate as stage3_generate


def test_requests_with_different_sampling_params_each_follow_their_own(tiny_models_root):
    path = tiny_models_root / "llama3"
    tok, model = engine_tokenizer(str(path)), engine_model(str(path))
    prompts = ["Hi", "Tell me a story", "x", "Once upon a time", "The end", "abc", "What is 2 + 2?", "Why?"]
    # A stop string and a stop token taken from what the greedy runs produce, so that they fire.
    # (The tiny tokenizer is byte-level: token id == byte value, so two ASCII tokens make a string.)
    probe = stage3_generate(
        model, tok, [prompts[4], prompts[6]], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    )
    ids = probe[0].output_ids
    k = next(k for k in range(len(ids) - 1) if all(32 <= t < 127 for t in ids[k : k + 2]))
    stop_string, stop_token = bytes(ids[k : k + 2]).decode(), probe[1].output_ids[5]
    params = [
        SamplingParams(temperature=0.7, top_k=30, max_new_tokens=9, seed=11),
        SamplingParams(temperature=0, max_new_tokens=5),
        SamplingParams(temperature=1.2, min_p=0.05, max_new_tokens=16, seed=12),
        SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12, seed=13, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=20, stop=[stop_string], ignore_eos=True),
        SamplingParams(temperature=1.0, max_new_tokens=3, seed=14),
        SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.8, min_p=0.1, max_new_tokens=11, seed=15),
    ]
    engine, _, traces = tiny_engine(path, pool_size=512, max_running_requests=5, max_prefill_tokens=40)
    got = engine.generate(prompts, params)
    expected = stage3_generate(model, tok, prompts, params)
    assert max(len(t.decode_rids) + len(t.prefill_rids) for t in traces) > 1, "the requests should share forward passes"
    for i, (g, e) in enumerate(zip(got, expected)):
        what = f"request {i} ({params[i]})"
        assert_same_tokens(g.output_ids, e.output_ids, f"{what}, vs stage 3", tok)
        assert g.finish_reason == e.finish_reason, (
            f"{what}: finish reason {g.finish_reason}, stage 3 says {e.finish_reason}"
        )
        assert g.text == e.text, f"{what}: text {g.text!r}, stage 3 says {e.text!r}"
        if params[i].seed is not None:
            assert g.seed == params[i].seed, f"{what}: the output should report seed {params[i].seed}, got {g.seed}"
    assert got[4].finish_reason.matched == stop_string, (
        f"request 4 should stop on {stop_string!r}, got {got[4].finish_reason}"
    )
    assert got[6].finish_reason.matched == stop_token, (
        f"request 6 should stop on token {stop_token}, got {got[6].finish_reason}"
    )
    # The same seeded request alone gives the same tokens: results never depend on the batch.
    alone, _, _ = tiny_engine(path, pool_size=512)
    [solo] = alone.generate([prompts[2]], params[2])
    assert_same_tokens(solo.output_ids, got[2].output_ids, "seeded request 2 alone vs in the batch", tok)
    assert_pool_free(engine, "mixed sampling params")


def test_logprobs_follow_each_request_through_retraction(tiny_models_root):
    """Requests that asked for logprobs, in a batch that keeps changing and under a pool so small
    that some are retracted and recomputed: each gets exactly one entry per output token (a
    recomputed prefill samples nothing new), equal to transformers', and the others get None."""
    path = tiny_models_root / "llama3"
    prompts, limits = retraction_workload()
    engine, _, _ = tiny_engine(path, pool_size=128, max_running_requests=8, new_token_ratio=0.0)
    params = [
        SamplingParams(temperature=0.8 if i % 3 else 0, max_new_tokens=n, ignore_eos=True, seed=i, logprobs=i % 4)
        if i % 2 == 0
        else SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        for i, n in enumerate(limits)
    ]
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.stats.num_retractions > 0, "the workload should retract some requests (pool of 128 slots)"
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if params[i].logprobs is None:
            assert out.logprobs is None, f"request {i} did not ask for logprobs, yet got {out.logprobs!r}"
        else:
            assert_logprobs_match(path, prompt, out, params[i].logprobs, f"request {i} of a retracting batch")
    assert_pool_free(engine, "after a retracting batch with logprobs")


def test_penalties_survive_retraction(tiny_models_root):
    """Penalised requests in a batch so short of memory that some are retracted and recomputed:
    their counts stay with the request (a recomputed prefill draws one token, counted once), so
    every request gets stage 3's tokens."""
    path = tiny_models_root / "llama3"
    prompts, _ = retraction_workload()
    params = (penalised_params(scale=2) * 4)[: len(prompts)]
    engine, _, _ = tiny_engine(path, pool_size=128, max_running_requests=8, new_token_ratio=0.0)
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.stats.num_retractions > 0, "the workload should retract some requests (pool of 128 slots)"
    assert_penalties_like_stage3(path, prompts, params, outputs, "a retracting batch")
    assert_pool_free(engine, "after a retracting batch with penalties")


def test_prompt_logprobs_through_retraction(tiny_models_root):
    """Requests that asked for their prompts' log-probabilities, in a batch so short of memory that
    some are retracted and computed again: each prompt is scored once (a recomputed prefill scores
    nothing again), equal to transformers'; then the mixed batch of prompt_logprob_cases."""
    path = tiny_models_root / "llama3"
    prompts, limits = retraction_workload()
    engine, _, _ = tiny_engine(path, pool_size=128, max_running_requests=8, new_token_ratio=0.0)
    asks = [i % 3 if i % 2 == 0 else None for i in range(len(prompts))]
    params = [
        SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, prompt_logprobs=k)
        for n, k in zip(limits, asks)
    ]
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.stats.num_retractions > 0, "the workload should retract some requests (pool of 128 slots)"
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if asks[i] is not None:
            assert_prompt_logprobs_match(path, prompt, out, asks[i], f"request {i} of a retracting batch")
    engine, _, _ = tiny_engine(path, pool_size=1024, max_running_requests=8)
    scored.assert_prompt_logprobs_case(
        path, engine.generate(scored.PROMPTS, scored.prompt_logprob_params()), "stage 5's engine"
    )
    assert_pool_free(engine, "after a batch with prompt_logprobs")
