"""Stage 12 (graded): 4 ranks on a model with 4 query heads and 2 KV heads (each KV head
replicated on two ranks) give one device's greedy tokens; then one of the ranks is killed, and
the group stops with a clear error naming it, in bounded time, leaving no process behind. One
group for the module (its start is the expensive part), stopped by the fixture whatever happens."""

from __future__ import annotations

import os
import signal
import time

import pytest

from s12_tensor_parallel.engine import TPEngine
from s12_tensor_parallel.parallel_state import TPGroupError
from tp_helpers import KNOBS, PROMPTS, greedy, pid_running, reference_outputs

TIMEOUT_S = 20.0  # the group's collective timeout: a dead rank must be reported well before it


@pytest.fixture(scope="module")
def tp4(tiny_models_root):
    path = tiny_models_root / "qwen3"
    engine = TPEngine(str(path), tp_size=4, tp_timeout_s=TIMEOUT_S, **KNOBS)
    pids = engine.launcher.pids
    try:
        yield path, engine
    finally:
        engine.shutdown()
    left = [pid for pid in pids if pid_running(pid)]
    assert not left, f"shutdown left rank processes running: {left}"


def test_four_ranks_with_replicated_kv_heads_give_one_devices_tokens(tp4):
    path, engine = tp4
    expected = reference_outputs(path, greedy(6))
    got = [out.output_ids for out in engine.generate(PROMPTS, greedy(6))]
    assert got == expected, f"qwen3, tp=4 (KV heads replicated): greedy tokens {got}, one device {expected}"


def test_a_killed_rank_stops_the_group_with_a_clear_error(tp4):
    path, engine = tp4
    engine.generate([[1, 2, 3]], greedy(3))  # the group works
    os.kill(engine.launcher.pids[1], signal.SIGKILL)  # rank 2
    start = time.monotonic()
    with pytest.raises(TPGroupError) as error:
        engine.generate([[4, 5, 6]], greedy(3))
    waited = time.monotonic() - start
    assert "rank 2" in str(error.value), f"the error should name the rank that died (rank 2): {error.value}"
    assert waited < TIMEOUT_S, f"the error took {waited:.1f} s (the group's timeout is {TIMEOUT_S} s)"
    engine.abort_failed_step()
    with pytest.raises(TPGroupError):  # and the engine says so at once from then on
        engine.generate([[4, 5, 6]], greedy(3))
