"""Starting and stopping the other ranks of a tensor-parallel group, from rank 0.

Rank 0 is the process that builds the engine (a script, a test, the server's scheduler
process). It starts ranks 1..N-1 as fresh interpreters with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so they join exactly as torchrun's workers would, then
joins the group itself as rank 0. (Not ``torch.multiprocessing.spawn``: the server's scheduler
is a daemonic multiprocessing child, and those may not start children of their own.) Under
``torchrun --nproc-per-node N -m s12_tensor_parallel`` torchrun starts every rank: rank 0 runs
the engine, which only joins, and the others run the follower loop.

A watchdog thread per rank copies its stderr to ours and notes the moment it fails (the line a
failing follower prints says why) or exits while the group is in use; the next
collective then fails with a message naming that rank (parallel_state.py), and every follower
exits when rank 0 goes (tp_worker.py). ``stop`` tells the followers to leave, waits a bounded
time, and kills any that did not: no process is left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch

from s09_zmq_serving.server_process import free_port  # (a port below the ephemeral range)

from .parallel_state import (
    DEFAULT_TIMEOUT_S,
    TPGroup,
    TPGroupError,
    destroy_tp_group,
    init_tp_group,
    init_tp_group_from_env,
)

STOP_TIMEOUT_S = 10.0  # a follower that has not left this long after "stop" is killed


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process (it sets TORCHELASTIC_RUN_ID for every rank)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def failure_line(rank: int) -> str:
    """How a follower that fails starts the line it prints on stderr (tp_worker.py): rank 0's
    watchdog reads that line as the reason the group stopped."""
    return f"tensor-parallel rank {rank} failed: "


class TPLauncher:
    def __init__(self, tp_size: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.tp_size, self.device, self.timeout_s = tp_size, device, timeout_s
        self.procs: list[subprocess.Popen] = []
        self.stopping = False

    def start(self) -> TPGroup:
        """Start ranks 1..N-1, join the group as rank 0 and return rank 0's TPGroup. Under
        torchrun, which has started every rank already, only join."""
        if self.tp_size == 1:
            return TPGroup(0, 1, self.device)
        if launched_by_torchrun():
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            if world != self.tp_size or rank != 0:
                raise TPGroupError(
                    f"under torchrun (WORLD_SIZE={world}, RANK={rank}) the engine is built on rank 0 with "
                    f"tp_size=WORLD_SIZE; the other ranks run tp_worker's follower_main"
                )
            return init_tp_group_from_env(self.device, self.timeout_s)
        port = free_port()
        for rank in range(1, self.tp_size):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(self.tp_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TP_DEVICE=self.device.type,
                TP_TIMEOUT_S=str(self.timeout_s),
            )
            command = [sys.executable, "-m", f"{__package__}.tp_worker"]
            proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
            self.procs.append(proc)
        tp = init_tp_group(0, self.tp_size, self.device, "127.0.0.1", port, self.timeout_s)
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self.watch, args=(tp, rank, proc), name=f"watch-rank-{rank}", daemon=True).start()
        return tp

    def watch(self, tp: TPGroup, rank: int, proc: subprocess.Popen) -> None:
        """Copy the rank's stderr to ours as it comes, and note in ``tp.failed`` why the rank
        stopped while the group was in use: the reason a failing follower prints (it comes before
        the follower's sockets close, so rank 0's failed collective can quote it), else its exit."""
        assert proc.stderr is not None
        prefix = failure_line(rank)
        for line in proc.stderr:  # until the rank exits and its end of the pipe closes
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):  # our stderr is gone: read on, or the rank would block writing its own
                pass
            if line.startswith(prefix):
                self.note_failure(tp, f"rank {rank} (pid {proc.pid}) failed: {line[len(prefix) :].strip()}")
        code = proc.wait()
        self.note_failure(tp, f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def note_failure(self, tp: TPGroup, why: str) -> None:
        if not self.stopping and tp.failed is None:  # the first reason is the cause; the rest follow from it
            tp.failed = why

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def stop(self, tp: TPGroup | None) -> None:
        """Tell the followers to leave (if the group still works), wait, kill what is left."""
        self.stopping = True
        told = False
        if tp is not None and tp.size > 1 and tp.failed is None:
            try:
                tp.broadcast_object(None)
                told = True
            except Exception:  # a group that fails now is being stopped anyway
                pass
        for proc in self.procs:
            if not told:  # a broken group: nobody will hear "stop"
                proc.kill()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if tp is not None:
            destroy_tp_group(tp)
