"""``OverlapEngine`` (the package's ``Engine``): stage 8's engine with the overlapped event loop,
same APIs, plus one config field::

    engine = Engine()                          # overlap where it pays (overlap_by_default): on with CUDA
    engine = Engine(disable_overlap=False)     # overlap on: step N+1 is scheduled while step N runs
    engine = Engine(disable_overlap=True)      # the same pieces in the plain order (schedule, run, process)
    engine.scheduler.timeline                  # StepTiming per step: CPU scheduling, forward, processing

Only the scheduler changes (stage 5's ``make_scheduler`` seam); the runner, with its CUDA graphs,
is stage 8's and runs on the worker (overlap_worker.py). ``make serve`` runs stage 11's engine,
which is this one with grammars (stage 9's ``--disable-overlap`` serves stage 8's instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from s00_foundation.device import physical_cores
from s05_continuous_batching.engine import EngineConfig
from s08_cuda_graph.engine import CudaGraphEngine, CudaGraphEngineConfig

from .scheduler import OverlapScheduler


def overlap_by_default(device: torch.device, forward_threads: int) -> tuple[bool, str]:
    """Whether the overlapped loop pays on ``device``, and why. It runs the scheduler's Python
    beside the forward, so it needs a core the forward leaves free: with CUDA the forward runs on
    the GPU; on a CPU, only when the forward's threads (``forward_threads``: torch's, times the
    processes that compute each step) leave a physical core. When they fill every core,
    the scheduler thread takes one from the forward's threads, which wait for each other at the end
    of every operation: on this course's 2-core machine, 2 torch threads, the overlapped engine
    took 1.7x as long as the plain one (README, "On a CPU, overlap needs a free core")."""
    if device.type != "cpu":
        return True, f"the forward runs on {device.type}"
    cores = physical_cores()
    if forward_threads < cores:
        return True, f"the forward's {forward_threads} thread(s) leave {cores - forward_threads} of {cores} cores free"
    return False, f"the forward's {forward_threads} threads fill the {cores} cores; the scheduler would slow it"


@dataclass
class OverlapEngineConfig(CudaGraphEngineConfig):
    """Stage 8's fields, plus ``disable_overlap``: True runs each step's scheduling and result
    processing while the device waits (stage 8's order), with the same scheduler; False overlaps
    them; None (the default) overlaps where it pays (``overlap_by_default``), as
    ``disable_cuda_graph`` uses graphs on CUDA only."""

    disable_overlap: bool | None = None


class OverlapEngine(CudaGraphEngine):
    config_class: ClassVar[type[EngineConfig]] = OverlapEngineConfig
    scheduler_class: ClassVar[type[OverlapScheduler]] = OverlapScheduler  # stage 11 names its own
    config: OverlapEngineConfig
    scheduler: OverlapScheduler
    overlap_reason: str  # why overlap is on or off, for describe()

    def make_scheduler(self) -> OverlapScheduler:
        c = self.config
        if c.disable_overlap is None:
            enable, why = overlap_by_default(self.model.device, self.forward_threads())
            self.overlap_reason = f"auto: {why}"
        else:
            enable, self.overlap_reason = not c.disable_overlap, "asked for"
        return self.scheduler_class(
            self.runner,
            self.make_prefix_cache(),
            enable_overlap=enable,
            chunked_prefill_size=self.chunked_prefill_size(offline=False),
            schedule_policy=c.schedule_policy,
            **self.scheduler_options(),
        )

    def forward_threads(self) -> int:
        """The CPU threads computing each step's forward: torch's (stage 12 counts every rank's)."""
        return torch.get_num_threads()

    def describe(self) -> str:
        overlap = "on (forward and sampling on a worker)" if self.scheduler.enable_overlap else "off"
        return super().describe() + f"\noverlap: {overlap} ({self.overlap_reason})"


Engine = OverlapEngine  # the stage's public name
