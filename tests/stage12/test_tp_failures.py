"""Stage 12 (graded): a rank that dies stops the group with a clear error, in bounded time, and
nothing is left running; a model that cannot be split is refused before any process starts."""

from __future__ import annotations

import os
import signal
import time

import pytest
from tp_helpers import KNOBS, greedy, pid_running

from s12_tensor_parallel.engine import TPEngine
from s12_tensor_parallel.parallel_state import TPGroupError

TIMEOUT_S = 20.0


def test_a_killed_rank_stops_the_group_with_a_clear_error(tiny_models_root):
    engine = TPEngine(str(tiny_models_root / "qwen2"), tp_size=2, tp_timeout_s=TIMEOUT_S, **KNOBS)
    pids = engine.launcher.pids
    try:
        engine.generate([[1, 2, 3]], greedy(3))  # the group works
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TPGroupError) as error:
            engine.generate([[4, 5, 6]], greedy(3))
        waited = time.monotonic() - start
        assert "rank 1" in str(error.value), f"the error should name the rank that died: {error.value}"
        assert waited < TIMEOUT_S, f"the error took {waited:.1f} s (the group's timeout is {TIMEOUT_S} s)"
        engine.abort_failed_step()
        with pytest.raises(TPGroupError):  # and the engine says so at once from then on
            engine.generate([[4, 5, 6]], greedy(3))
    finally:
        engine.shutdown()
    left = [pid for pid in pids if pid_running(pid)]
    assert not left, f"processes left after shutdown: {left}"


def test_an_unsplittable_model_is_refused_before_any_process_starts(tiny_models_root):
    # qwen3's tiny model: 4 query heads, 2 KV heads; 3 ranks cannot split either
    with pytest.raises(ValueError) as error:
        TPEngine(str(tiny_models_root / "qwen3"), tp_size=3, **KNOBS)
    assert "tp_size=3" in str(error.value), f"the error should name tp_size=3: {error.value}"
