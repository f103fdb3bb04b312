"""Stage 12 (graded): a forward that fails on rank 0 after its broadcast stops the group, and a
follower that fails is named in rank 0's error with its own exception.

Its own module: one torch.distributed group per process (each test here shuts its engine down
before the next starts), and test_tp_engine.py's groups live until that module ends."""

from __future__ import annotations

import pytest

from s12_tensor_parallel.engine import TPEngine
from s12_tensor_parallel.parallel_state import TPGroupError
from tp_helpers import KNOBS, greedy, pid_running


def test_a_forward_rank_0_leaves_midway_stops_the_group(tiny_models_root):
    """The other ranks run every batch rank 0 broadcasts: a forward that fails on rank 0 after the
    broadcast leaves them inside a collective, and a next step would pair its collectives with
    theirs. So the group stops, naming why, and fails every later step at once."""
    engine = TPEngine(str(tiny_models_root / "qwen2"), tp_size=2, tp_timeout_s=10, **KNOBS)
    pids = engine.launcher.pids
    try:
        engine.generate([[1, 2, 3]], greedy(2))  # the group works
        backend = engine.runner.attn_backend
        real = backend.init_forward_metadata

        def fails_once(batch):
            backend.init_forward_metadata = real
            raise RuntimeError("injected: rank 0 fails after the broadcast")

        backend.init_forward_metadata = fails_once
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate([[4, 5, 6]], greedy(2))
        engine.abort_failed_step()
        why = engine.fatal_error()
        assert why and "rank 0's forward failed midway" in why, (
            f"after a forward rank 0 left midway, engine.fatal_error() should say the group stopped, and why: {why!r}"
        )
        with pytest.raises(TPGroupError, match="forward failed midway"):  # at once, not out of step with rank 1
            engine.generate([[7, 8, 9]], greedy(2))
    finally:
        engine.shutdown()
    left = [pid for pid in pids if pid_running(pid)]
    assert not left, f"shutdown left rank processes running: {left}"


def test_a_follower_that_fails_is_named_with_its_exception(tiny_models_root):
    """A follower that fails prints why on its stderr, and rank 0's watchdog reads that line: the
    error rank 0 raises names the rank, its exception and where in the course's code it was
    raised, not only that a rank exited (its traceback is in another process's log)."""
    engine = TPEngine(str(tiny_models_root / "qwen2"), tp_size=2, tp_timeout_s=10, **KNOBS)
    pids = engine.launcher.pids
    try:
        assert engine.tp is not None
        engine.tp.broadcast_object("not a batch")  # the follower's loop expects a BatchMessage
        with pytest.raises(TPGroupError) as raised:
            engine.generate([[1, 2, 3]], greedy(2))
    finally:
        engine.shutdown()
    message = str(raised.value)
    assert "rank 1" in message and "AttributeError" in message and "in follower_loop" in message, (
        "rank 1 failed on a message that was not a BatchMessage (AttributeError in follower_loop); rank 0's error "
        f"should say so (tp_worker prints the reason with failure_line, launch.TPLauncher.watch reads it): {message}"
    )
    left = [pid for pid in pids if pid_running(pid)]
    assert not left, f"shutdown left rank processes running: {left}"
