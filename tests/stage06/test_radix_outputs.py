"""Stage 6 (graded): the radix cache changes how much is computed, never which tokens come out.

Shared system prompts, identical prompts, prompts that are prefixes of others and prompts that
diverge inside a cached edge give every request exactly the tokens it gets without the cache (and
alone, stage 3); the prefill tokens computed are exactly the uncached ones; a small pool that
forces evictions (and retractions) changes nothing either."""

from __future__ import annotations

import random

import pytest

import prompt_logprob_cases as scored
from radix_helpers import assert_nothing_held_but_the_tree, radix_engine, run_all
from reference import assert_same_tokens, engine_model
from s03_kv_cache.generate import cached_generate

SYSTEM = [ord(c) for c in "You are a helpful assistant. Answer briefly and kindly."]  # 55 tokens


def question(first: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [first] + [rng.randrange(32, 127) for _ in range(length - 1)]


def shared_workload():
    """Prompts sharing the system prompt (questions start with distinct tokens), an identical
    repeat, a prefix of another, and one that leaves a cached question in the middle."""
    questions = [question(65 + i, 6 + i, seed=i) for i in range(5)]
    prompts = [SYSTEM + q for q in questions]
    prompts.append(list(prompts[1]))  # identical to request 1
    prompts.append(prompts[2][: len(SYSTEM) + 4])  # a prefix of request 2
    prompts.append(prompts[3][: len(SYSTEM) + 3] + [200, 201, 202])  # leaves request 3's question inside its edge
    prompts.append(SYSTEM[:20] + [240, 241])  # leaves the system prompt in the middle
    return prompts, [6, 4, 5, 7, 3, 6, 4, 5, 3]


# lpm matches every waiting prompt to order the queue before admission does (splitting the edges
# they leave), fcfs does not: admission's own match then meets the edges to split
@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_shared_prefix_workload_equals_no_cache_and_alone(tiny_model_dir, policy):
    prompts, limits = shared_workload()
    what = f"{tiny_model_dir.name}, shared-system-prompt workload, schedule_policy={policy!r}"
    cached, _ = radix_engine(tiny_model_dir, pool_size=1024, max_running_requests=4, schedule_policy=policy)
    plain, _ = radix_engine(tiny_model_dir, enable_radix_cache=False, pool_size=1024, max_running_requests=4)
    # The first request alone first, so the others find the system prompt cached.
    got = run_all(cached, prompts[:1], limits[:1], what) + run_all(cached, prompts[1:], limits[1:], what)
    expected = run_all(plain, prompts, limits, what + " without the cache")
    model = engine_model(str(tiny_model_dir))
    for i, (req, ref, prompt, n) in enumerate(zip(got, expected, prompts, limits)):
        who = f"{what}: request {i} ({len(prompt)}-token prompt, {n} new tokens)"
        assert_same_tokens(req.output_ids, ref.output_ids, f"{who}, with the radix cache vs without")
        assert_same_tokens(
            req.output_ids, cached_generate(model, prompt, n), f"{who}, with the radix cache vs alone (stage 3)"
        )
    assert cached.scheduler.stats.cached_tokens >= 8 * 20, (
        f"{what}: the later requests share at least 20 prompt tokens each with earlier ones, yet admitted requests "
        f"found only {cached.scheduler.stats.cached_tokens} tokens cached in all"
    )
    assert_nothing_held_but_the_tree(cached, what)


def test_prefill_tokens_computed_are_exactly_the_uncached_ones(tiny_models_root):
    path = tiny_models_root / "qwen3"
    engine, recorder = radix_engine(path, pool_size=2048, max_running_requests=8)
    q = [question(65 + i, 5 + 2 * i, seed=10 + i) for i in range(4)]
    first = SYSTEM + q[0]
    run_all(engine, [first], [4], "the first request")
    assert engine.scheduler.stats.prefill_tokens == len(first), (
        f"the first request finds nothing cached and computes its whole {len(first)}-token prompt; "
        f"stats.prefill_tokens is {engine.scheduler.stats.prefill_tokens}"
    )
    # Three more share the system prompt: computed once already, so each computes only its question.
    before = engine.scheduler.stats.prefill_tokens
    run_all(engine, [SYSTEM + x for x in q[1:]], [4, 4, 4], "three requests sharing the system prompt")
    computed = engine.scheduler.stats.prefill_tokens - before
    expected = sum(len(x) for x in q[1:])
    assert computed == expected, (
        f"three requests share the {len(SYSTEM)}-token system prompt already cached; they should compute only their "
        f"questions ({[len(x) for x in q[1:]]} = {expected} tokens) but computed {computed} prefill tokens"
    )
    # The same prompt again: everything is cached, yet one token is recomputed for its logits.
    before, passes = engine.scheduler.stats.prefill_tokens, len(recorder.passes)
    [again] = run_all(engine, [first], [4], "the first prompt again")
    assert engine.scheduler.stats.prefill_tokens - before == 1 and recorder.passes[passes] == ([1], [len(first) - 1]), (
        f"a prompt identical to a finished one is cached entirely, but its last token must still be computed "
        f"(its logits give the first new token): expected one prefill of 1 token after {len(first) - 1} cached, "
        f"got the pass (extend_lens, prefix_lens) = {recorder.passes[passes]}"
    )
    # A prompt that diverges 3 tokens into a cached question: the system prompt + 3 tokens are reused.
    branch = SYSTEM + q[2][:3] + [250, 251]
    before = engine.scheduler.stats.prefill_tokens
    run_all(engine, [branch], [3], "a prompt diverging inside a cached question")
    assert engine.scheduler.stats.prefill_tokens - before == 2, (
        f"this prompt shares {len(SYSTEM) + 3} tokens with a cached one (diverging inside its edge) and should compute "
        f"its last 2 tokens only; it computed {engine.scheduler.stats.prefill_tokens - before}"
    )
    model = engine_model(str(path))
    assert_same_tokens(
        again.output_ids, cached_generate(model, first, 4), "the repeated prompt (1 token recomputed), vs alone"
    )
    assert_nothing_held_but_the_tree(engine, "qwen3, prefill counting")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_eviction_under_memory_pressure_keeps_outputs_identical(tiny_models_root, page_size):
    path = tiny_models_root / "llama3"
    rng = random.Random(7)
    prefixes = [SYSTEM[:24], SYSTEM[24:48]]
    prompts = [prefixes[i % 2] + question(65 + i, rng.randint(2, 10), seed=20 + i) for i in range(14)]
    limits = [rng.randint(8, 16) for _ in prompts]
    what = f"page size {page_size}, a 160-slot pool"
    # 160 slots hold a few requests and a little of the tree: finished requests' K/V must be evicted
    # for new ones (new_token_ratio=0 also forces retractions).
    engine, _ = radix_engine(path, pool_size=160, page_size=page_size, max_running_requests=6, new_token_ratio=0.0)
    reqs = run_all(engine, prompts, limits, what)
    cache = engine.tree_cache
    assert cache.evicted_tokens > 0, (
        f"{what}: this workload cannot fit the tree and the running requests, yet cache.evicted_tokens is 0: evict() "
        "adds what it frees to self.evicted_tokens (or did nothing get evicted?)"
    )
    assert engine.scheduler.stats.cached_tokens > 0, f"{what}: no admitted request found its shared prefix cached"
    model = engine_model(str(path))
    for i, (req, prompt, n) in enumerate(zip(reqs, prompts, limits)):
        who = (
            f"{what} ({cache.evicted_tokens} tokens evicted, {engine.scheduler.stats.num_retractions} retractions): "
            f"request {i} ({len(prompt)}-token prompt, {n} new tokens)"
        )
        assert req.finished and req.finished_reason.type == "length", (
            f"{who}: should finish with 'length', got {req.finished_reason}"
        )
        assert_same_tokens(req.output_ids, cached_generate(model, prompt, n), f"{who}, vs alone (stage 3)")
    assert_nothing_held_but_the_tree(engine, what)


def test_prompt_logprobs_with_a_cached_prefix(tiny_models_root):
    """A cached prefix has no logits. The same batch twice: the second time the tree holds every
    prompt, yet each asking request's prompt is scored whole (it takes from the cache only what
    it already scored: Req.max_prefix_len), while the others still use the cache."""
    path = tiny_models_root / "llama"
    engine, _ = radix_engine(path, pool_size=1024)
    scored.assert_prompt_logprobs_case(
        path, engine.generate(scored.PROMPTS, scored.prompt_logprob_params()), "stage 6, first run"
    )
    cached_before = engine.scheduler.stats.cached_tokens
    scored.assert_prompt_logprobs_case(
        path,
        engine.generate(scored.PROMPTS, scored.prompt_logprob_params()),
        "stage 6, again with every prompt in the tree",
    )
    silent = [len(prompt) - 1 for prompt, k in zip(scored.PROMPTS, scored.TOP_KS) if k is None]
    cached = engine.scheduler.stats.cached_tokens - cached_before
    assert cached == sum(silent), (
        f"the second run should take {' + '.join(map(str, silent))} prompt tokens from the tree (all but the last "
        f"of each request that did not ask; an asking request takes none: it has scored nothing yet), took {cached}"
    )
    assert_nothing_held_but_the_tree(engine, "after the batches with prompt_logprobs")
