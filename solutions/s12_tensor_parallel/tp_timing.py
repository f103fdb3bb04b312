"""Where a tensor-parallel step's time goes: rank 0's forward, split into compute and
communication (``TPGroup.comm_seconds``: the collectives and the batch's broadcast), for tp=1 and
tp=N on the same requests.
Shared by the milestone (``python -m s12_tensor_parallel``) and notebook 12.

The runs use the plain loop (``disable_overlap=True``): each step's forward then runs alone, and
its span in the scheduler's timeline is the forward's own time. (The engine overlaps where it
pays, under TP as without it; this measurement turns it off.)"""

from __future__ import annotations

import time

from .engine import TPEngine


def measure(model: str, tp_size: int, prompts, params, **knobs) -> dict:
    """One warm-up request, then the workload; per-step means in milliseconds and the tokens."""
    with TPEngine(model, tp_size=tp_size, disable_overlap=True, **knobs) as engine:
        engine.tp.time_collectives = True  # on CUDA: wait for each collective to time it
        engine.generate(prompts[:1], params)  # warm-up: first-call allocations
        steps0, comm0 = engine.scheduler.stats.steps, engine.tp.comm_seconds
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        steps = engine.scheduler.stats.steps - steps0
        comm = engine.tp.comm_seconds - comm0
        forward = sum(t.forward[1] - t.forward[0] for t in list(engine.scheduler.timeline)[-steps:])
    tokens = sum(len(out.output_ids) for out in outputs)
    return dict(
        tp=tp_size,
        steps=steps,
        step_ms=1e3 * wall / steps,
        forward_ms=1e3 * forward / steps,
        comm_ms=1e3 * comm / steps,
        compute_ms=1e3 * (forward - comm) / steps,
        tokens_per_s=tokens / wall,
        output_ids=[out.output_ids for out in outputs],
    )
