"""Measured timelines: where each step's time went, with and without overlap.

The scheduler records a ``StepTiming`` per step (scheduler.py): when the CPU built and launched
it, when the worker ran its forward and sampling, when the CPU processed its results. From those
intervals this module computes what the lesson and notebook 10 show::

    hidden   the share of the CPU's scheduling and processing time that ran while some forward
             was running (0 without overlap: the device waits for every bit of it)
    idle     the share of the wall time in which no forward ran (the device's waiting)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from s05_continuous_batching.engine import RequestOutput

from .engine import OverlapEngine
from .scheduler import StepTiming


@dataclass
class TimedRun:
    outputs: list[RequestOutput]
    wall: float  # seconds, first add_request to the last result
    timeline: list[StepTiming]


def timed_generate(engine, prompts, params) -> TimedRun:
    """``engine.generate`` with its scheduler's timeline of that run."""
    engine.scheduler.timeline.clear()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return TimedRun(outputs, time.perf_counter() - start, list(engine.scheduler.timeline))


def overlap_length(interval: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Seconds of ``interval`` covered by ``others`` (which do not overlap each other)."""
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others)


def summarize(run: TimedRun) -> dict[str, float]:
    """Per-step means (milliseconds) and the hidden / idle shares of one run."""
    steps = run.timeline
    forwards = [t.forward for t in steps]
    cpu = [interval for t in steps for interval in (t.schedule, t.process)]
    cpu_time = sum(b - a for a, b in cpu)
    forward_time = sum(b - a for a, b in forwards)
    tokens = sum(o.output_tokens for o in run.outputs)
    return {
        "steps": len(steps),
        "schedule_ms": 1000 * sum(t.schedule[1] - t.schedule[0] for t in steps) / len(steps),
        "forward_ms": 1000 * forward_time / len(steps),
        "process_ms": 1000 * sum(t.process[1] - t.process[0] for t in steps) / len(steps),
        "step_ms": 1000 * run.wall / len(steps),
        "hidden": sum(overlap_length(c, forwards) for c in cpu) / cpu_time if cpu_time else 0.0,
        "idle": 1 - forward_time / run.wall,
        "tokens_per_s": tokens / run.wall,
    }


def compare(model, tokenizer, prompts, params, repeats: int = 1, **knobs) -> dict[str, tuple[TimedRun, dict]]:
    """The same requests on two engines over one model, overlap off and on, each run ``repeats``
    times after a warm-up, the two modes taking turns (so that a busy machine slows both alike); the
    fastest run of each is kept. Returns {"off"|"on": (run, summary)}."""
    engines = {name: OverlapEngine(model, tokenizer, disable_overlap=name == "off", **knobs) for name in ("off", "on")}
    runs: dict[str, list[TimedRun]] = {name: [] for name in engines}
    for engine in engines.values():
        engine.generate(prompts[:2], params[:2] if isinstance(params, list) else params)  # warm-up, the worker's start
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name].append(timed_generate(engine, prompts, params))
    best = {name: min(found, key=lambda run: run.wall) for name, found in runs.items()}
    return {name: (run, summarize(run)) for name, run in best.items()}
