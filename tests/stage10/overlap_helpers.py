"""Shared by the stage-10 tests: tiny-model engines of stage 10 (and stage 8's, the reference for
token identity) driven step by step, with every invariant checked after every step and every
token a step streams compared with what the request finally holds."""

from __future__ import annotations

import random

import torch

from invariants import capped_steps, check_all, watch_evict
from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s08_cuda_graph.engine import CudaGraphEngine
from s10_overlap_scheduling.engine import OverlapEngine


def engine_on(path, stage: int = 10, **knobs):
    """A stage-10 (or stage-8) engine on a tiny model; knobs go to its constructor. A stage-10
    engine overlaps unless told otherwise, on any machine (its own default depends on the cores)."""
    cls = OverlapEngine if stage == 10 else CudaGraphEngine
    if stage == 10:
        knobs.setdefault("disable_overlap", False)
    engine = cls(engine_model(str(path)), engine_tokenizer(str(path)), **knobs)
    if engine.tree_cache is not None:
        watch_evict(engine.tree_cache)
    return engine


def greedy(max_new_tokens: int, **more) -> SamplingParams:
    # ignore_eos: the tiny random models may emit their EOS id; the references run to the limit too
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True, **more)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def check_finished_left_running(engine, where: str) -> None:
    """No request that has finished is still in the running list (stage 10 moves one the step in
    flight holds to ``ending``): else it is never released, and the loop never runs dry."""
    stayed = [req for req in engine.scheduler.running if req.finished]
    assert not stayed, (
        f"{where}: request(s) {[req.rid for req in stayed]} finished ({stayed[0].finished_reason.type}) but are still "
        "in the running list: a request that finishes when its step is processed leaves self.running at once (to "
        "self.ending while the step in flight still holds it, else released), or nothing ever releases it"
    )


def stepped(engine, what: str, max_steps: int = 999):
    """Yield each step's outputs until the engine has no work, checking every invariant after each
    step, for at most ``max_steps`` steps (a request that never leaves would keep it going)."""
    for step in capped_steps(engine, max_steps, what):
        outputs = engine.step()
        check_finished_left_running(engine, f"{what}, after step {step}")
        check_all(engine, f"{what}, after step {step}")
        yield outputs


def step_until_idle(engine, what: str) -> list:
    """Step until the engine has no work, checked as ``stepped`` does; returns every output."""
    with torch.inference_mode():
        return [out for outputs in stepped(engine, what) for out in outputs]


def run_checked(engine, prompts, params, what: str, aborts: dict | None = None, max_steps: int = 5000):
    """Add every request, then step until the engine is idle, checking after each step the pool's
    and the tree's invariants and that no stream ever gets a future id, a token after its end, or
    a token its request does not hold. ``aborts``: {step number: [rids]} aborted after that step
    (each must be running or waiting then). Returns (requests, streams: rid -> streamed tokens)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streams: dict = {req.rid: [] for req in reqs}
    ended = set()
    steps = 0
    with torch.inference_mode():
        while engine.has_work:
            steps += 1
            where = f"{what}, after step {steps}"
            try:
                outputs = engine.step()
            except IndexError as error:
                raise AssertionError(
                    f"{where}: step() raised IndexError ({error}): did a future id (negative) reach the model? "
                    "resolve must replace each one, in the batch's own input_ids, before the forward"
                ) from error
            except ValueError as error:
                if "double free" not in str(error):
                    raise
                raise AssertionError(
                    f"{where}: {error}\n  (under overlap, release_ended frees only the pages after the positions a "
                    "request keeps: from pages_for(keep) * page_size, the first page boundary at or after keep; a page "
                    "that still holds a kept position leaves with the request, in release_req)"
                ) from error
            for out in outputs:
                assert out.rid not in ended, (
                    f"{where}: request {out.rid} got tokens {out.new_token_ids} after its stream had ended"
                )
                assert all(t >= 0 for t in out.new_token_ids), (
                    f"{where}: request {out.rid} streamed {out.new_token_ids}: a future id (negative) reached the "
                    "user; it must be replaced by the token step N sampled before the output is made"
                )
                streams[out.rid] += out.new_token_ids
                if out.finish_reason is not None:
                    ended.add(out.rid)
            check_finished_left_running(engine, where)
            try:
                check_all(engine, where)
            except AssertionError as error:
                raise AssertionError(
                    f"{error}\n  (a common cause under overlap: a request that finished at step N, but was already in "
                    "step N+1 in flight, must be released only when step N+1 is processed, dropping that step's "
                    "extra position then)"
                ) from None
            for rid in (aborts or {}).get(steps, []):
                assert engine.abort_request(rid), (
                    f"{where}: abort_request({rid!r}) found no such request waiting or running"
                )
                ended.add(rid)
            assert steps < max_steps, f"{what}: the engine still has work after {max_steps} steps: is a request stuck?"
    for req in reqs:
        if req.finished_reason.type != "abort":
            assert streams[req.rid] == req.output_ids, (
                f"{what}: request {req.rid} streamed {streams[req.rid]} but holds {req.output_ids} at the end"
            )
    return reqs, streams


def assert_pool_free_after_tree(engine, what: str) -> None:
    """Idle engine: every slot is free or held by the radix tree, every table row is free."""
    allocator, pool = engine.runner.allocator, engine.runner.req_to_token_pool
    held = engine.tree_cache.total_size() if engine.tree_cache is not None else 0
    assert allocator.size - allocator.available_size() >= held
    tree_pages = len(torch.unique(engine.scheduler.prefix_cache.cached_slots().reshape(-1) // allocator.page_size))
    assert allocator.size - allocator.available_size() == tree_pages * allocator.page_size, (
        f"{what}: idle, {allocator.size - allocator.available_size()} slots are not free but the tree holds "
        f"{tree_pages * allocator.page_size}: a request that ended under overlap did not free what it held"
    )
    assert len(pool.free_slots) == pool.size, (
        f"{what}: idle, but table rows {sorted(set(range(pool.size)) - set(pool.free_slots))} are not free"
    )


def tree_paths(cache) -> list[list[int]]:
    """Every root-to-leaf token path of a radix tree, sorted: what it caches, whatever its shape."""
    paths = []

    def walk(node, prefix):
        if not node.children:
            if prefix:
                paths.append(prefix)
            return
        for child in node.children.values():
            walk(child, prefix + list(child.key))

    walk(cache.root, [])
    return sorted(paths)
