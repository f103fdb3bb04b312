"""Stage 12's start barrier (not graded: the group's plumbing is given, not an exercise). Rank 0
waits there while every other rank loads its shard and builds its runner, which on a busy machine
(or one where another process is compiling the fused CPU kernel, which the rank then waits for)
takes longer than a forward's collective may: the barrier is bounded by START_TIMEOUT, not by the
group's short timeout. A rank that dies before it still fails the barrier at once."""

from __future__ import annotations

import subprocess
import sys
import time

from s12_tensor_parallel.launch import free_port

RANK = """
import sys, time
from s12_tensor_parallel.parallel_state import destroy_tp_group, init_tp_group
rank, port, delay, exit_early = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
tp = init_tp_group(rank, 2, "cpu", "127.0.0.1", port, timeout_s=2)  # a forward's collective: 2 s
time.sleep(delay)  # building this rank's runner
if exit_early:
    raise SystemExit(3)
start = time.monotonic()
try:
    tp.barrier()
except Exception as error:
    print("failed", round(time.monotonic() - start, 1), type(error).__name__, error, flush=True)
    raise SystemExit(1)
print("ready", round(time.monotonic() - start, 1), flush=True)
destroy_tp_group(tp)
"""


def two_ranks(follower_delay: float, follower_exits: bool) -> tuple[subprocess.CompletedProcess, float]:
    port = free_port()
    start = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(port), str(delay), str(int(exits))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, delay, exits in ((0, 0.0, False), (1, follower_delay, follower_exits))
    ]
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].communicate(timeout=120)
    done = subprocess.CompletedProcess(ranks[0].args, ranks[0].returncode, out, err)
    return done, time.monotonic() - start


def test_rank_0_waits_at_start_for_a_rank_slower_than_the_forward_timeout():
    done, _ = two_ranks(follower_delay=5.0, follower_exits=False)
    assert done.returncode == 0 and done.stdout.startswith("ready"), (
        f"rank 0's start barrier gave up on a rank that took 5 s to build its runner (the forward's "
        f"timeout is 2 s; the start's is START_TIMEOUT):\n{done.stdout}\n{done.stderr[-2000:]}"
    )


def test_a_rank_that_dies_before_the_barrier_fails_it_at_once():
    done, seconds = two_ranks(follower_delay=1.0, follower_exits=True)
    assert done.returncode == 1 and "TPGroupError" in done.stdout, f"{done.stdout}\n{done.stderr[-2000:]}"
    assert seconds < 60, f"rank 0 noticed the dead rank only after {seconds:.0f} s"
