"""The stuck watch (tests/stuck_watch.py): a test still running at its mark is announced with
where it is, and a test found where an earlier one got stuck is failed there, not at the limit."""

from __future__ import annotations

import importlib.util
import signal
import threading
import time

import pytest

from stuck_watch import INTERRUPT, StuckWatch

LOOPS = """
def spin(stop):
    step(stop)

def step(stop):
    stop.wait()
"""


@pytest.fixture
def course(tmp_path):
    """A module of "course code" under its own root (spin calls step, which waits: step is always
    the innermost frame), and a watch over that root. The session's own watch gets its signal
    handler back afterwards."""
    root = tmp_path / "stages"
    root.mkdir()
    path = root / "loops_for_the_watch.py"
    path.write_text(LOOPS)
    spec = importlib.util.spec_from_file_location("loops_for_the_watch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    said: list[str] = []
    previous = signal.getsignal(INTERRUPT) if INTERRUPT is not None else None
    watch = StuckWatch([root.resolve()], tmp_path, after_s=0.3, say=said.append)
    yield module, watch, said, root
    if INTERRUPT is not None:
        signal.signal(INTERRUPT, previous)


def spin_for(module, seconds: float) -> None:
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    try:
        module.spin(stop)
    finally:
        timer.cancel()


def test_a_test_past_its_mark_is_announced_with_where_it_is(course):
    module, watch, said, _ = course
    with watch.running("tests/test_x.py::test_slow"):
        spin_for(module, 0.8)
    assert len(said) == 1, f"one notice for a test that ran past its 0.3 s mark, got {said}"
    assert "[still running after 0.3 s] tests/test_x.py::test_slow" in said[0], said[0]
    assert "now in stages/loops_for_the_watch.py:3 in spin > :6 in step." in said[0], (
        f"the notice should name the lines of course code the test is in: {said[0]}"
    )

    with watch.running("tests/test_x.py::test_quick"):
        spin_for(module, 0.05)
    time.sleep(0.4)
    assert len(said) == 1, f"a test that ended before its mark is not announced: {said[1:]}"

    # pytest.mark.takes(1.0): a test known to take a second (a server starting) is said later
    with watch.running("tests/test_x.py::test_server", takes_s=1.0):
        spin_for(module, 0.8)
    assert len(said) == 1, f"a test marked as taking 1 s is not announced at 0.8 s: {said[1:]}"
    with watch.running("tests/test_x.py::test_server", takes_s=1.0):
        spin_for(module, 1.4)
    assert len(said) == 2 and "[still running after 1 s]" in said[1], said[1:]


@pytest.mark.skipif(INTERRUPT is None, reason="the watch stops a test with a signal (POSIX)")
def test_a_test_where_an_earlier_one_got_stuck_fails_at_its_mark(course):
    module, watch, said, root = course
    path = str(root / "loops_for_the_watch.py")
    where = watch.got_stuck(
        "tests/test_x.py::test_first", [("pytest.py", 1, "main"), (path, 3, "spin"), (path, 6, "step")]
    )
    assert where == "stages/loops_for_the_watch.py:3 in spin > :6 in step", where

    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        with watch.running("tests/test_x.py::test_second"):
            spin_for(module, 10)
    took = time.monotonic() - start
    assert took < 3, f"the second test should be stopped at its 0.3 s mark, it ran {took:.1f} s"
    message = str(failed.value)
    assert message.startswith("stuck again: still running after 0.3 s in stages/loops_for_the_watch.py:"), message
    assert "tests/test_x.py::test_first got stuck before" in message, message
    assert said == [], f"a test that is stopped is not also announced: {said}"


def test_only_the_innermost_course_function_is_compared(course):
    """A slow test that passes through the function an earlier test looped in, but is busy
    deeper down, is announced, not failed."""
    module, watch, said, root = course
    watch.got_stuck("tests/test_x.py::test_first", [(str(root / "loops_for_the_watch.py"), 3, "spin")])
    with watch.running("tests/test_x.py::test_second"):
        spin_for(module, 0.8)
    assert len(said) == 1 and "[still running after 0.3 s] tests/test_x.py::test_second" in said[0], (
        f"spin is only the outer frame (step is the innermost): a notice, not a failure; got {said}"
    )
