"""Shared by the stage-6 tests: tiny-model engines with and without the radix cache, whose forward
passes are recorded and whose evictions are watched (invariants.watch_evict), and a runner that
checks every invariant after every step."""

from __future__ import annotations

from typing import cast

import torch

from invariants import check_all, watch_evict
from recording import PassRecorder
from reference import engine_model, engine_tokenizer
from s00_foundation.model import CausalLM
from s02_request_and_sampling.sampling_params import SamplingParams
from s06_radix_cache.engine import Engine


def radix_engine(path, enable_radix_cache: bool = True, **knobs):
    """(engine, recorder) on a tiny model; knobs go to the stage-6 Engine (pool_size, ...)."""
    recorder = PassRecorder(engine_model(str(path)))
    model = cast(CausalLM, recorder)  # the recorder passes itself off as the model
    engine = Engine(model, engine_tokenizer(str(path)), enable_radix_cache=enable_radix_cache, **knobs)
    if engine.tree_cache is not None:
        watch_evict(engine.tree_cache)
    return engine, recorder


def greedy(max_new_tokens: int) -> SamplingParams:
    # ignore_eos: the tiny random models may emit their EOS id; the references run to the limit too
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


def run_all(engine, prompts, limits, what: str, max_steps: int = 10_000):
    """Add every request, step to the end checking the scheduler's and the tree's invariants
    after each step; returns the requests (in the prompts' order)."""
    reqs = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, limits)]
    steps = 0
    with torch.inference_mode():
        while engine.has_work:
            engine.step()
            steps += 1
            check_all(engine, f"{what}, after step {steps}")
            assert steps < max_steps, f"{what}: the engine still has work after {max_steps} steps: is a request stuck?"
    return reqs


def assert_nothing_held_but_the_tree(engine, what: str) -> None:
    """After a workload: every slot is free or held by the tree; freeing the tree frees the pool."""
    check_all(engine, what)
    allocator, cache = engine.runner.allocator, engine.tree_cache
    held = allocator.size - allocator.available_size()
    in_tree = cache.total_size() if cache is not None else 0
    assert cache is None or cache.protected_size_ == 0, (
        f"{what}: nothing runs, yet {cache.protected_size_} cached tokens are still locked"
    )
    if cache is not None:
        cache.evict(allocator.size)
        assert cache.total_size() == 0, f"{what}: evicting everything left {cache.total_size()} tokens in the tree"
    assert allocator.available_size() == allocator.size, (
        f"{what}: {held} slots were taken with the tree holding {in_tree} tokens; after evicting the whole tree "
        f"{allocator.size - allocator.available_size()} are still taken (a leak)"
    )
