"""Stage 8's engine with the overlapped event loop: same APIs, plus one knob::

    engine = Engine()                          # overlap on: step N+1 is scheduled while step N runs
    engine = Engine(disable_overlap=True)      # the same pieces in the plain order (schedule, run, process)
    engine.scheduler.timeline                  # StepTiming per step: CPU scheduling, forward, processing

Only the scheduler changes (stage 5's ``make_scheduler`` seam); the runner, with its CUDA graphs,
is stage 8's and runs on the worker (overlap_worker.py). This is the engine ``make serve`` runs.
"""

from __future__ import annotations

from s08_cuda_graph.engine import Engine as BaseEngine

from .scheduler import OverlapScheduler


class Engine(BaseEngine):
    def __init__(self, model=None, tokenizer=None, *, disable_overlap: bool = False, **knobs):
        """``model``, ``tokenizer`` and ``knobs``: see stages 5-8. ``disable_overlap``: run each
        step's scheduling and result processing while the device waits (stage 8's order)."""
        super().__init__(model, tokenizer, **knobs)
        self.disable_overlap = disable_overlap
        self.scheduler.enable_overlap = not disable_overlap

    def make_scheduler(self, **knobs) -> OverlapScheduler:
        return OverlapScheduler(
            self.runner, self.make_prefix_cache(), chunked_prefill_size=self.chunked_prefill_size,
            schedule_policy=self.schedule_policy, **knobs,
        )

    def describe(self) -> str:
        return super().describe() + f"\noverlap: {'off' if self.disable_overlap else 'on (forward and sampling on a worker)'}"
