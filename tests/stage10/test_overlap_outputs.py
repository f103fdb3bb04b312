"""Stage 10 (graded): overlap changes when the CPU works, never which tokens come out.

Greedy tokens equal transformers' for every tiny model family, with and without overlap; under
every knob (page sizes 1, 4 and 16, chunked prefill, the radix cache on and off, pools so small
that requests are retracted) greedy and seeded requests get exactly the tokens stage 8's engine
gives them, the pool and tree invariants hold after every step, and every stream equals its
request's tokens."""

from __future__ import annotations

import pytest
import torch

import prompt_logprob_cases as scored
from overlap_helpers import assert_pool_free_after_tree, engine_on, greedy, random_prompt, run_checked, stepped
from penalty_cases import assert_penalties_like_stage3, penalised_params
from reference import assert_logprobs_match, assert_same_tokens, hf_greedy
from s00_foundation.device import physical_cores
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.engine import request_output
from s10_overlap_scheduling.engine import overlap_by_default


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_greedy_tokens_identical_to_transformers(tiny_model_dir, disable_overlap):
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 23, 4, 40)]
    limits = [6, 1, 5, 8, 3]
    what = f"{tiny_model_dir.name}, {'no ' if disable_overlap else ''}overlap"
    engine = engine_on(tiny_model_dir, disable_overlap=disable_overlap, pool_size=1024)
    reqs, _ = run_checked(engine, prompts, [greedy(n) for n in limits], what)
    for i, (req, prompt, n) in enumerate(zip(reqs, prompts, limits)):
        assert_same_tokens(req.output_ids, hf_greedy(tiny_model_dir, prompt, n), f"{what}: request {i} vs transformers")
    assert_pool_free_after_tree(engine, what)


def mixed_workload():
    """Greedy and seeded requests of assorted lengths, three of them sharing a 19-token prefix."""
    shared = random_prompt(19, seed=5)
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 30, 11, 1)] + [
        shared + random_prompt(n, seed=n) for n in (2, 13, 7)
    ]
    params = [
        greedy(7)
        if i % 2
        else SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, max_new_tokens=5 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


KNOBS = {
    "plain": dict(pool_size=1024),
    "chunked": dict(pool_size=1024, chunked_prefill_size=6),
    "no-radix": dict(pool_size=1024, enable_radix_cache=False, chunked_prefill_size=9),
    "small-pool": dict(pool_size=48, max_running_requests=6, new_token_ratio=0.0),
    "small-pool-chunked": dict(pool_size=48, max_running_requests=6, new_token_ratio=0.0, chunked_prefill_size=5),
}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_every_knob_gives_the_tokens_of_stage_8(tiny_models_root, page_size):
    path = tiny_models_root / "qwen3"
    prompts, params = mixed_workload()
    for name, knobs in KNOBS.items():
        base = f"qwen3, page_size={page_size}, {name}"
        reference, _ = run_checked(
            engine_on(path, stage=8, page_size=page_size, **knobs), prompts, params, f"{base}, stage 8"
        )
        for disable_overlap in (False, True):
            what = f"{base}, {'no ' if disable_overlap else ''}overlap"
            engine = engine_on(path, page_size=page_size, disable_overlap=disable_overlap, **knobs)
            reqs, _ = run_checked(engine, prompts, params, what)
            for i, (req, ref) in enumerate(zip(reqs, reference)):
                assert_same_tokens(
                    req.output_ids, ref.output_ids, f"{what}: request {i} ({params[i]}) vs stage 8's engine"
                )
            if "small-pool" in name:
                assert engine.scheduler.stats.num_retractions > 0, (
                    f"{what}: the pool was meant to be too small, yet nothing was retracted"
                )
            assert_pool_free_after_tree(engine, what)


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_a_shared_system_prompt_is_computed_once_under_overlap(tiny_models_root, disable_overlap):
    path = tiny_models_root / "qwen3"
    system, tails = random_prompt(60, seed=11), [5, 7, 3, 6]
    prompts = [system + random_prompt(n, seed=20 + n) for n in tails]
    what = f"qwen3, {'no ' if disable_overlap else ''}overlap, 4 requests sharing a 60-token prefix, tails {tails}"
    engine = engine_on(path, disable_overlap=disable_overlap, pool_size=1024)
    reqs, _ = run_checked(engine, prompts, greedy(4), what)
    unshared = len(system) + sum(tails)
    assert engine.scheduler.stats.prefill_tokens == unshared, (
        f"{what}: the passes computed {engine.scheduler.stats.prefill_tokens} prompt tokens, the unshared part is "
        f"{unshared}: with overlap the first request's prompt reaches the tree only when its step is processed, "
        "after the next step is built, so stage 7's in-batch check (held_back) must count the prompts of the step "
        "in flight as ahead too, and share_prompts must hand the prompt to the tree when that step is processed"
    )
    for req, prompt in zip(reqs, prompts):
        assert_same_tokens(req.output_ids, hf_greedy(path, prompt, 4), f"{what}: request {req.rid} vs transformers")
    assert_pool_free_after_tree(engine, what)


def test_overlap_is_on_by_default_only_where_the_scheduler_has_a_core(tiny_models_root):
    """disable_overlap=None (the default): overlap with CUDA, and on a CPU only when the forward's
    threads leave a physical core to the scheduler (with every core computing, the scheduler's
    thread slows the forward more than overlap saves); the tokens are transformers' either way."""
    path, cores, before = tiny_models_root / "llama", physical_cores(), torch.get_num_threads()
    assert overlap_by_default(torch.device("cuda"), 64)[0], "with CUDA the forward runs on the GPU: overlap pays"
    prompts, limits = [random_prompt(n, seed=n) for n in (5, 17)], [6, 4]
    try:
        for threads in sorted({1, cores}):
            what = f"llama, the default overlap, {threads} torch thread(s) on {cores} physical core(s)"
            engine = engine_on(path, disable_overlap=None, torch_threads=threads, pool_size=512)
            assert engine.scheduler.enable_overlap == (threads < cores), (
                f"{what}: overlap should be {'on' if threads < cores else 'off'} by default "
                f"(on a CPU: on only when torch's threads leave a core free), is "
                f"{'on' if engine.scheduler.enable_overlap else 'off'}"
            )
            assert "(auto: " in engine.describe(), f"{what}: describe() should say why: {engine.describe()}"
            reqs, _ = run_checked(engine, prompts, [greedy(n) for n in limits], what)
            for i, (req, prompt, n) in enumerate(zip(reqs, prompts, limits)):
                assert_same_tokens(req.output_ids, hf_greedy(path, prompt, n), f"{what}: request {i} vs transformers")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_logprobs_arrive_with_their_tokens(tiny_models_root, disable_overlap):
    """The worker computes the logprobs where the logits are; the scheduler hands each one out with
    its token: every streamed step's entries name exactly its new tokens, a request that ended while
    the next step was in flight gains no entry for the dropped token, and the entries equal
    transformers'."""
    path = tiny_models_root / "llama3"
    engine = engine_on(path, disable_overlap=disable_overlap, pool_size=512)
    prompts = [random_prompt(n, seed=n) for n in (3, 9, 17, 5, 30, 12)]
    params = [
        SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_new_tokens=1 + i, ignore_eos=True, logprobs=i % 3)
        if i != 3
        else greedy(6)
        for i in range(len(prompts))
    ]
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streamed: dict = {req.rid: [] for req in reqs}
    with torch.inference_mode():
        for outputs in stepped(engine, f"llama3, logprobs, overlap {'off' if disable_overlap else 'on'}"):
            for out in outputs:
                asked = next(r for r in reqs if r.rid == out.rid).sampling_params.logprobs is not None
                got = [e.token_id for e in out.new_logprobs]
                assert got == (list(out.new_token_ids) if asked else []), (
                    f"request {out.rid}: a step streamed tokens {out.new_token_ids} with logprob entries for {got}; "
                    + ("each new token comes with its entry" if asked else "it did not ask for logprobs")
                )
                streamed[out.rid] += out.new_logprobs
    for i, req in enumerate(reqs):
        if params[i].logprobs is None:
            assert req.output_logprobs == [], f"request {i} did not ask, yet holds {req.output_logprobs}"
            continue
        assert streamed[req.rid] == req.output_logprobs, f"request {i}: the streamed entries differ from what it holds"
        out = request_output(req)
        assert_logprobs_match(path, prompts[i], out, params[i].logprobs, f"request {i} (overlap {not disable_overlap})")


@pytest.mark.parametrize("knobs", ["plain", "small-pool-chunked"])
@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_penalties_count_the_token_in_flight(tiny_models_root, disable_overlap, knobs):
    """Under overlap the worker samples step N+1 before the scheduler has seen step N's token: the
    penalty counts, kept by the sampler on the worker, already hold it. Same tokens as stage 3,
    with retraction and chunked prefill too."""
    path = tiny_models_root / "qwen3"
    prompts = [random_prompt(n, seed=60 + n) for n in (4, 21, 9, 1, 14, 10, 6)]
    params = (penalised_params() * 2)[: len(prompts)]
    what = f"qwen3, {knobs}, {'no ' if disable_overlap else ''}overlap"
    engine = engine_on(path, disable_overlap=disable_overlap, **KNOBS[knobs])
    reqs, _ = run_checked(engine, prompts, params, what)
    if "small-pool" in knobs:
        assert engine.scheduler.stats.num_retractions > 0, f"{what}: the pool was meant to be too small"
    assert_penalties_like_stage3(path, prompts, params, reqs, what)
    assert_pool_free_after_tree(engine, what)


@pytest.mark.parametrize("disable_overlap", [False, True])
def test_prompt_logprobs_under_overlap(tiny_models_root, disable_overlap):
    """The worker reads the prompt rows where the logits are and the scheduler attaches them when
    it processes the step: each prompt scored once and in order, chunks included, with and
    without overlap; twice, the second time with the prompts in the tree."""
    path = tiny_models_root / "qwen3"
    engine = engine_on(path, chunked_prefill_size=8, disable_overlap=disable_overlap)
    for run in ("first run", "again, prompts cached"):
        outputs = engine.generate(scored.PROMPTS, scored.prompt_logprob_params())
        scored.assert_prompt_logprobs_case(path, outputs, f"overlap {not disable_overlap}, {run}")
    assert_pool_free_after_tree(engine, "after prompt_logprobs")
