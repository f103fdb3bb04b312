"""Stage 5 (graded): no KV slot leaks. Finished and aborted requests give their slots and table
rows back at once, and after any workload the whole pool is free again (retracted requests:
test_continuous_retraction.py)."""

from __future__ import annotations

import pytest
import torch

from continuous_helpers import assert_pool_free, greedy, tiny_engine, workload
from invariants import capped_steps
from reference import assert_same_tokens, engine_model, hf_greedy
from s02_request_and_sampling.sampling_params import SamplingParams
from s03_kv_cache.generate import cached_generate


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_finished_requests_free_their_slots_in_the_same_step(tiny_models_root, page_size):
    path = tiny_models_root / "qwen2"
    prompts, limits = workload(12, seed=3, max_prompt=30, max_new=12)
    pool = 1024
    engine, _, traces = tiny_engine(path, pool_size=pool, page_size=page_size, max_running_requests=5)
    for p, n in zip(prompts, limits):
        engine.add_request(p, greedy(n))
    with torch.inference_mode():
        for _ in capped_steps(engine):
            engine.step()
            running = engine.scheduler.running
            held = sum(-(-req.cached_len // page_size) for req in running) * page_size
            free = engine.runner.allocator.available_size()
            trace = traces[-1]
            assert free == pool - held, (
                f"step {trace.step}: the {len(running)} running requests hold {held} slots (page size {page_size}), so "
                f"{pool - held} should be free, but {free} are (finished: {trace.finished_rids}); a finished request "
                "must free its slots in the step it finishes"
            )
            for rid in trace.finished_rids:
                assert all(req.rid != rid for req in running), (
                    f"step {trace.step}: request {rid} finished but still runs"
                )
            engine.scheduler.check_invariants()
    assert_pool_free(engine, f"page size {page_size}")


def test_pool_is_fully_free_after_stops_and_aborts(tiny_models_root):
    path = tiny_models_root / "llama"
    prompts, limits = workload(10, seed=8, max_prompt=30, max_new=20)
    # Requests 0-2 end early on a stop token / EOS that they are known to produce.
    stops = {i: hf_greedy(path, prompts[i], limits[i])[limits[i] // 2] for i in range(3)}
    params = [
        SamplingParams(
            temperature=0, max_new_tokens=n, stop_token_ids=[stops[i]] if i in stops else [], ignore_eos=True
        )
        for i, n in enumerate(limits)
    ]
    engine, _, _ = tiny_engine(path, pool_size=512, max_running_requests=4)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    with torch.inference_mode():
        for _ in range(3):
            engine.step()
        running = [r for r in engine.scheduler.running if r.rid not in stops]
        waiting = list(engine.scheduler.waiting)
        assert running and waiting, "after 3 steps some requests should run and some wait (max_running_requests=4)"
        aborted = {running[-1].rid, waiting[-1].rid}
        for rid in aborted:
            assert engine.abort_request(rid), f"abort_request({rid}) should find the request"
            engine.scheduler.check_invariants()  # an aborted running request frees its slots at once
        assert not engine.abort_request("no such request"), "abort_request of an unknown id should return False"
        for _ in capped_steps(engine):
            engine.step()
            engine.scheduler.check_invariants()
    model = engine_model(str(path))
    for req, prompt, n in zip(reqs, prompts, limits):
        if req.rid in aborted:
            assert req.finished_reason.type == "abort", (
                f"request {req.rid} was aborted, finish reason {req.finished_reason}"
            )
            continue
        expected = cached_generate(model, prompt, n, eos_token_ids=[stops[req.rid]] if req.rid in stops else ())
        assert_same_tokens(req.output_ids, expected, f"request {req.rid} (next to two aborted requests), vs alone")
    assert_pool_free(engine, "after stops and aborts")
