"""``OverlapEngine`` (the package's ``Engine``): stage 8's engine with the overlapped event loop,
same APIs, plus one config field::

    engine = Engine()                          # overlap on: step N+1 is scheduled while step N runs
    engine = Engine(disable_overlap=True)      # the same pieces in the plain order (schedule, run, process)
    engine.scheduler.timeline                  # StepTiming per step: CPU scheduling, forward, processing

Only the scheduler changes (stage 5's ``make_scheduler`` seam); the runner, with its CUDA graphs,
is stage 8's and runs on the worker (overlap_worker.py). ``make serve`` runs this engine (stage 9's
``--disable-overlap`` serves stage 8's instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from s05_continuous_batching.engine import EngineConfig
from s08_cuda_graph.engine import CudaGraphEngine, CudaGraphEngineConfig

from .scheduler import OverlapScheduler


@dataclass
class OverlapEngineConfig(CudaGraphEngineConfig):
    """Stage 8's fields, plus ``disable_overlap``: True runs each step's scheduling and result
    processing while the device waits (stage 8's order), with the same scheduler."""

    disable_overlap: bool = False


class OverlapEngine(CudaGraphEngine):
    config_class: ClassVar[type[EngineConfig]] = OverlapEngineConfig
    scheduler_class: ClassVar[type[OverlapScheduler]] = OverlapScheduler  # stage 11 names its own
    config: OverlapEngineConfig
    scheduler: OverlapScheduler

    def make_scheduler(self) -> OverlapScheduler:
        c = self.config
        return self.scheduler_class(
            self.runner,
            self.make_prefix_cache(),
            enable_overlap=not c.disable_overlap,
            chunked_prefill_size=c.chunked_prefill_size,
            schedule_policy=c.schedule_policy,
            **self.scheduler_options(),
        )

    def describe(self) -> str:
        overlap = "off" if self.config.disable_overlap else "on (forward and sampling on a worker)"
        return super().describe() + f"\noverlap: {overlap}"


Engine = OverlapEngine  # the stage's public name
