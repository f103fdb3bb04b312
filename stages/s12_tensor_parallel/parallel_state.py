"""The tensor-parallel group: which rank this process is, and the collectives the layers call.

SGLang keeps its groups in module globals (``get_tp_group()`` in ``distributed/parallel_state.py``);
here the group is one object, ``TPGroup``, handed to every layer that talks to the other ranks,
so a test can count what a forward sends (``TPGroup.counts``) and a notebook can time it.

Two process groups join the same ranks:

- the **device group** (NCCL on CUDA, gloo on a CPU) carries the forward's collectives: an
  all-reduce after each row-parallel linear and after the embedding, a gather of the logits.
  Its timeout is short (``timeout_s``): a rank that died makes the others' next collective fail
  within that time instead of hanging.
- the **control group** (always gloo, on the host) carries rank 0's messages: each step's batch,
  the runner's shape at start, the order to stop. A rank that waits here may wait as long as the
  server is idle, so this group's timeout is a day, not seconds. The start's barrier (every rank
  has built its runner) runs here too, bounded by ``START_TIMEOUT``.

Every rank joins at ``tcp://MASTER_ADDR:MASTER_PORT`` with its RANK and the WORLD_SIZE (torchrun's
variables), so the same code runs under ``torchrun`` across machines.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0  # a forward's collective waits at most this long for a silent rank
CONTROL_TIMEOUT = timedelta(days=1)  # a follower waits for the next batch as long as the server idles
# Rank 0 waits this long at start for the others to build their runners: loading a shard, and on a
# CPU compiling the fused kernel on first use, can take minutes on a busy machine (a rank that dies
# meanwhile still fails the wait at once: its connection closes).
START_TIMEOUT = timedelta(minutes=10)


class TPGroupError(RuntimeError):
    """The tensor-parallel group cannot go on: a rank died or a collective failed or timed out."""


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    device_group: Any = None  # None when size == 1: no collective is ever called
    control_group: Any = None
    counts: Counter = field(default_factory=Counter)  # collectives called, by name
    comm_seconds: float = 0.0  # time inside the collectives and broadcasts (on CUDA: when timed)
    # On CUDA a collective is only queued: timing it means waiting for the device after each one,
    # which a server must not do. So on CUDA the time is measured only when this is set.
    time_collectives: bool = False
    failed: str | None = None  # why the group cannot go on: rank 0's watchdog, a failed collective, or a
    # forward rank 0 left midway (model_runner.py) set it

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # --- the forward's collectives (device group) ------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over every rank, in place; every rank gets the sum."""
        if self.size == 1:
            return x
        start = self._start("all_reduce")
        with self.failing_clearly("all_reduce"):
            dist.all_reduce(x, group=self.device_group)
        self._stop(start)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``x`` concatenated along the last dimension (in rank order);
        the other ranks get None."""
        if self.size == 1:
            return x
        start = self._start("gather")
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        with self.failing_clearly("gather"):
            dist.gather(x, parts, dst=0, group=self.device_group)
        self._stop(start)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def barrier(self) -> None:
        """Wait until every rank is here: the start's barrier, once each rank has built its runner
        (on the control group, bounded by START_TIMEOUT rather than a forward's short timeout).
        gloo's monitored barrier takes a timeout on every torch this course meets (plain
        ``barrier`` has none on torch 2.11, the GPU image's), and rank 0's error names a rank that
        never came."""
        if self.size > 1:
            with self.failing_clearly("barrier"):
                dist.monitored_barrier(group=self.control_group, timeout=START_TIMEOUT)

    @contextmanager
    def failing_clearly(self, what: str) -> Iterator[None]:
        """Turn a collective's failure (a peer gone, a timeout) into a TPGroupError saying which
        rank died when the watchdog knows; once failed, every later collective fails at once."""
        if self.failed is not None:
            raise TPGroupError(f"the tensor-parallel group has stopped: {self.failed}")
        try:
            yield
        except Exception as error:
            time.sleep(0.2)  # let the watchdog see the dead process, if one died
            why = self.failed or f"{what} failed on rank {self.rank}: {type(error).__name__}: {error}"
            self.failed = why
            raise TPGroupError(f"the tensor-parallel group has stopped: {why}") from error

    def _start(self, name: str) -> float:
        self.counts[name] += 1
        return time.perf_counter()

    def _stop(self, start: float) -> None:
        if self.device.type == "cuda":
            if not self.time_collectives:
                return
            torch.cuda.synchronize(self.device)  # the time the collective took, not its launch
        self.comm_seconds += time.perf_counter() - start

    # --- rank 0's messages (control group) ----------------------------------------------------------

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (any picklable object); every rank returns it."""
        box = [obj]
        start = self._start("broadcast")
        with self.failing_clearly("broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.control_group)
        self._stop(start)  # (each step's batch goes this way: communication too, not compute)
        return box[0]


def init_tp_group(
    rank: int,
    size: int,
    device: torch.device | str,
    master_addr: str,
    master_port: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join the group as ``rank`` of ``size`` (a TCP rendezvous at master_addr:master_port, which
    rank 0 hosts); returns this rank's TPGroup. One group per process: torch.distributed's default
    group is process-wide."""
    device = torch.device(device)
    if size == 1:
        return TPGroup(0, 1, device)
    if dist.is_initialized():
        raise TPGroupError("this process already belongs to a torch.distributed group; shut that engine down first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # on the host, whatever the device
    return TPGroup(rank, size, device, dist.group.WORLD, control)


def init_tp_group_from_env(device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """``init_tp_group`` from torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise TPGroupError(f"joining the group needs {', '.join(missing)} in the environment (torchrun sets them)")
    return init_tp_group(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        device,
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        timeout_s,
    )


def destroy_tp_group(tp: TPGroup) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
