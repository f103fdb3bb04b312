"""Stage 6 (graded): longest-prefix-match admission - waiting requests with more of their prompt
cached go first, ties in arrival order - with FCFS beside it and as the fallback for long queues."""

from __future__ import annotations

from collections import deque

import torch

from invariants import capped_steps
from radix_helpers import assert_nothing_held_but_the_tree, greedy, radix_engine, run_all
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool.allocator import TokenToKVPoolAllocator
from s06_radix_cache.radix_cache import RadixCache
from s06_radix_cache.schedule_policy import SchedulePolicy

SHARED = list(range(40, 80))


def admission_order(tiny_models_root, policy):
    engine, _ = radix_engine(tiny_models_root / "qwen2", pool_size=1024, max_running_requests=1, schedule_policy=policy)
    run_all(engine, [SHARED + [90, 91]], [3], "the warm-up request")
    prompts = {"none": [100, 101, 102, 103], "some": SHARED[:10] + [120, 121], "most": SHARED + [90, 92]}
    reqs = {rid: engine.add_request(p, greedy(2), rid=rid) for rid, p in prompts.items()}
    with torch.inference_mode():
        for _ in capped_steps(engine):
            engine.step()
            engine.scheduler.check_invariants()
            engine.tree_cache.check()
    assert_nothing_held_but_the_tree(engine, f"policy {policy}")
    return sorted(reqs, key=lambda rid: reqs[rid].time_stats.scheduled[0])


def test_lpm_admits_the_longest_cached_prefix_first(tiny_models_root):
    order = admission_order(tiny_models_root, "lpm")
    assert order == ["most", "some", "none"], (
        "with schedule_policy='lpm' and one request at a time, the waiting requests should run longest cached prefix "
        f"first: 'most' (41 tokens cached), 'some' (10), 'none' (0); they ran in the order {order}"
    )


def test_fcfs_keeps_arrival_order(tiny_models_root):
    order = admission_order(tiny_models_root, "fcfs")
    assert order == ["none", "some", "most"], f"with schedule_policy='fcfs' requests run in arrival order; got {order}"


def test_lpm_falls_back_to_fcfs_on_a_long_queue():
    allocator = TokenToKVPoolAllocator(128)
    cache = RadixCache(allocator)
    slots = allocator.alloc_extend([0], [6], [0])
    cache.insert([1, 2, 3, 4, 5, 6], slots)
    reqs = [Req(i, ids, SamplingParams()) for i, ids in enumerate([[9, 9, 9], [1, 2, 7], [1, 2, 3, 4, 5, 6, 7]])]
    waiting = deque(reqs)
    SchedulePolicy("lpm", cache, fallback_queue_len=8).calc_priority(waiting)
    assert [r.rid for r in waiting] == [2, 1, 0], (
        "LPM on a short queue: request 2 has 6 tokens cached, 1 has 2, 0 none; the queue became "
        f"{[r.rid for r in waiting]}"
    )
    waiting = deque(reqs)
    SchedulePolicy("lpm", cache, fallback_queue_len=2).calc_priority(waiting)
    assert [r.rid for r in waiting] == [0, 1, 2], (
        "LPM on a queue longer than fallback_queue_len must fall back to FCFS; the queue became "
        f"{[r.rid for r in waiting]}"
    )
    cache.check()
