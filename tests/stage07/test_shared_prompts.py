"""Stage 7 (graded): requests that arrive together with the same long prefix compute it once.

A prompt goes into the radix tree as soon as its last chunk is computed (not only when its
request leaves), and a waiting request that would compute again at least IN_BATCH_SHARED_MIN
tokens that a request ahead of it computes in the same pass waits one step. A
system prompt shared by many requests is then computed once, and every request computes only its
own tail: the prefill tokens are exactly the unshared part."""

from __future__ import annotations

import pytest
import torch

from chunked_helpers import assert_pool_free_after_tree, chunked_engine, greedy, random_prompt, run_checked
from reference import assert_same_tokens, hf_greedy
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.trace import StepTrace
from s07_chunked_prefill.scheduler import IN_BATCH_SHARED_MIN


def system_prompt_workload(shared: int, tails: list[int], seed: int = 0) -> list[list[int]]:
    system = random_prompt(shared, seed=seed)
    return [system + random_prompt(n, seed=seed + 1 + i) for i, n in enumerate(tails)]


@pytest.mark.parametrize("budget", [512, 24], ids=["whole-prompts", "chunked-by-24"])
def test_a_shared_system_prompt_is_computed_once(tiny_models_root, budget):
    path = tiny_models_root / "llama"
    shared, tails = 60, [5, 7, 3, 6, 4, 5]
    prompts = system_prompt_workload(shared, tails)
    what = f"llama, {len(prompts)} requests sharing a {shared}-token prefix with tails {tails}, budget {budget}"
    engine, _ = chunked_engine(path, budget, pool_size=1024)
    reqs = run_checked(engine, prompts, greedy(4), what)
    stats = engine.scheduler.stats
    unshared = shared + sum(tails)
    # Chunked, the request admitted beside the first one's last chunk (less than IN_BATCH_SHARED_MIN
    # tokens of its prefix are left then) may compute those again: at most one budget's worth.
    allowed = 0 if budget > shared + max(tails) else budget
    assert unshared <= stats.prefill_tokens <= unshared + allowed, (
        f"{what}: the passes computed {stats.prefill_tokens} prompt tokens, the unshared part is {unshared} "
        f"(the prefix once, then each tail; {allowed} more allowed): the first request's prompt goes into the tree "
        "after its prefill (share_prompts: cache_unfinished_req for every request, not only a chunked one), and "
        f"the others, sharing at least {IN_BATCH_SHARED_MIN} uncached tokens with a request ahead of them, wait a "
        "step instead of computing the prefix again (held_back)"
    )
    for req, prompt in zip(reqs, prompts):
        assert_same_tokens(req.output_ids, hf_greedy(path, prompt, 4), f"{what}: request {req.rid} vs transformers")
    assert_pool_free_after_tree(engine, what)


def test_a_held_back_request_waits_one_step_and_others_overtake_it(tiny_models_root):
    path = tiny_models_root / "qwen3"
    system = random_prompt(50, seed=1)
    prompts = [system + random_prompt(4, seed=2), random_prompt(20, seed=3), system + random_prompt(6, seed=4)]
    what = "qwen3: A (50-token prefix + 4), B (unrelated, 20), C (A's prefix + 6), added together"
    traces: list[StepTrace] = []
    engine, _ = chunked_engine(path, 512, pool_size=1024, trace=traces.append)
    run_checked(engine, prompts, greedy(3), what)
    prefills = [trace.prefill_rids for trace in traces]
    assert prefills[0] == [0, 1] and prefills[1] == [2], (
        f"{what}: step 1 should prefill A and B and hold C back (it would compute A's prefix again in the same "
        f"pass), step 2 C alone, on A's prefix from the tree; the steps prefilled {prefills[:3]}"
    )
    assert engine.scheduler.stats.prefill_tokens == 50 + 4 + 20 + 6, (
        f"{what}: C should compute only its 6-token tail, yet the passes computed "
        f"{engine.scheduler.stats.prefill_tokens} prompt tokens (74 expected)"
    )


def test_a_request_scoring_its_prompt_is_not_held_back(tiny_models_root):
    """A request that asks for prompt_logprobs takes nothing from the tree while it scores its prompt
    (a cached position has no logits): waiting a step behind a request sharing its prefix would gain
    it nothing, so it is admitted beside it, and its prompt is scored whole."""
    path = tiny_models_root / "qwen3"
    system = random_prompt(50, seed=1)
    prompts = [system + random_prompt(4, seed=2), system + random_prompt(6, seed=4)]
    params = [greedy(3), SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, prompt_logprobs=0)]
    what = "qwen3: A (50-token prefix + 4), then C (A's prefix + 6) asking for prompt_logprobs, added together"
    traces: list[StepTrace] = []
    engine, _ = chunked_engine(path, 512, pool_size=1024, trace=traces.append)
    reqs = run_checked(engine, prompts, params, what)
    assert traces[0].prefill_rids == [0, 1], (
        f"{what}: both should be admitted in the first step (C could take nothing of A's prefix from the tree: "
        f"held_back counts only what a request may take, req.max_prefix_len); step 1 prefilled "
        f"{traces[0].prefill_rids}"
    )
    assert len(reqs[1].prompt_logprobs) == len(prompts[1]) - 1, f"{what}: C's prompt should be scored whole"


def test_a_small_overlap_does_not_hold_anyone_back(tiny_models_root):
    path = tiny_models_root / "llama"
    common = random_prompt(20, seed=7)
    prompts = [common + random_prompt(30, seed=8), common + random_prompt(30, seed=9)]
    what = (
        f"llama, two 50-token requests sharing only their first 20 tokens (fewer than IN_BATCH_SHARED_MIN = "
        f"{IN_BATCH_SHARED_MIN})"
    )
    traces: list[StepTrace] = []
    engine, _ = chunked_engine(path, 512, pool_size=1024, trace=traces.append)
    reqs = run_checked(engine, prompts, greedy(3), what)
    assert traces[0].prefill_rids == [0, 1], (
        f"{what}: both should be admitted in the first step (so small an overlap is not worth a step of "
        f"waiting); step 1 prefilled {traces[0].prefill_rids}"
    )
    for req, prompt in zip(reqs, prompts):
        assert_same_tokens(req.output_ids, hf_greedy(path, prompt, 3), f"{what}: request {req.rid} vs transformers")


def test_without_the_radix_cache_nobody_waits(tiny_models_root):
    path = tiny_models_root / "llama"
    prompts = system_prompt_workload(40, [3, 4])
    what = "llama, radix cache off, two requests sharing a 40-token prefix"
    traces: list[StepTrace] = []
    engine, _ = chunked_engine(path, 512, pool_size=1024, enable_radix_cache=False, trace=traces.append)
    with torch.inference_mode():
        run_checked(engine, prompts, greedy(2), what)
    assert traces[0].prefill_rids == [0, 1], (
        f"{what}: with nothing shared, holding a request back only delays it; step 1 prefilled {traces[0].prefill_rids}"
    )
