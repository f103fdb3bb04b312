"""Shared by the stage-7 tests: tiny-model engines with chunked prefill whose forward passes are
recorded, and a runner that checks every invariant after every step and that nobody is sampled
before its whole prompt has been computed."""

from __future__ import annotations

import contextlib
import random

import torch

import s02_request_and_sampling.engine as stage2_engine  # append_sampled: where every scheduler samples
from invariants import check_all, check_chunked_req_not_running, watch_evict
from recording import PassRecorder
from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s07_chunked_prefill.engine import Engine


def chunked_engine(path, chunked_prefill_size, **knobs):
    """(engine, recorder) on a tiny model; knobs go to the stage-7 Engine (pool_size, ...). Every
    step (generate()'s too) ends with the half-prefilled request's rule checked, so that a broken
    rule is named in the step that broke it, whatever the test looks at."""
    recorder = PassRecorder(engine_model(str(path)))
    engine = Engine(recorder, engine_tokenizer(str(path)), chunked_prefill_size=chunked_prefill_size, **knobs)
    if engine.tree_cache is not None:
        watch_evict(engine.tree_cache)
    real_step = engine.step
    steps = 0

    def checked_step():
        nonlocal steps
        pending = engine.scheduler.chunked_req
        outputs = real_step()
        steps += 1
        check_chunked_req_not_running(engine, f"after step {steps}")
        check_not_lost(engine, pending, f"after step {steps}")
        return outputs

    engine.step = checked_step
    return engine, recorder


def check_not_lost(engine, pending, what: str) -> None:
    """The request that was half prefilled before a step is, after it, still half prefilled,
    running, waiting (retracted) or finished: anywhere else, no step would ever run it again."""
    scheduler = engine.scheduler
    if pending is None or pending.finished or pending is scheduler.chunked_req:
        return
    if not any(req is pending for req in (*scheduler.running, *scheduler.waiting)):
        raise AssertionError(
            f"{what}: request {pending.rid} was half prefilled (chunked_req) before this step and is now nowhere: not "
            "chunked_req, running, waiting nor finished. admit_new_requests returns the half-prefilled request's "
            "next chunk first, with the newly admitted requests, and step() makes them all running"
        )


def greedy(max_new_tokens: int) -> SamplingParams:
    # ignore_eos: the tiny random models may emit their EOS id; the references run to the limit too
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


@contextlib.contextmanager
def sampling_spy(what: str):
    """Wrap the sampler the scheduler calls: fail if a request is sampled before its whole
    prompt (fill_ids) has been computed. Yields the list of sampled request ids, in order."""
    sampled, real_sample = [], stage2_engine.sample_with_penalties

    def spy(logits, reqs):
        for req in reqs:
            assert req.device_len == len(req.fill_ids), (
                f"{what}: request {req.rid} was sampled with only {req.device_len} of its {len(req.fill_ids)} tokens "
                "computed: a request whose prefill is unfinished must not be sampled (its logits mean nothing yet)"
            )
            sampled.append(req.rid)
        return real_sample(logits, reqs)

    stage2_engine.sample_with_penalties = spy
    try:
        yield sampled
    finally:
        stage2_engine.sample_with_penalties = real_sample


def run_checked(engine, prompts, params, what: str, max_steps: int = 20_000):
    """Add every request, step to the end checking invariants after each step and that no step
    reports a token for a request whose prefill is unfinished; returns the requests."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    with sampling_spy(what), torch.inference_mode():
        while engine.has_work:
            outputs = engine.step()
            steps += 1
            where = f"{what}, after step {steps}"
            check_all(engine, where)
            pending = engine.scheduler.chunked_req
            if pending is not None:
                assert all(out.rid != pending.rid for out in outputs), (
                    f"{where}: step() reported output for request {pending.rid}, whose prefill is still unfinished"
                )
            assert steps < max_steps, f"{what}: the engine still has work after {max_steps} steps: is a request stuck?"
    return reqs


def assert_pool_free_after_tree(engine, what: str) -> None:
    """After a workload: nothing locked, and evicting the whole tree frees the whole pool."""
    check_all(engine, what)
    allocator, cache = engine.runner.allocator, engine.tree_cache
    if cache is not None:
        assert cache.protected_size_ == 0, (
            f"{what}: nothing runs, yet {cache.protected_size_} cached tokens are still locked"
        )
        cache.evict(allocator.size)
    assert allocator.available_size() == allocator.size, (
        f"{what}: nothing runs and the tree is evicted, yet {allocator.size - allocator.available_size()} of "
        f"{allocator.size} KV slots are not free: a chunk's slots leaked"
    )
