"""The stuck watch (tests/stuck_watch.py): a test still running at its mark is announced with
where it is, and a test found where an earlier one got stuck is failed there, not at the limit."""

from __future__ import annotations

import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stuck_watch import INTERRUPT, StuckTest, StuckWatch, qualname_from_source

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


def test_a_test_waiting_for_the_kernels_build_is_announced_as_a_wait(course, tmp_path):
    """Waiting for the shared kernel build of another process was announced as a loop that may never
    end, which alarmed learners whose code was fine."""
    _, watch, said, root = course
    path = root / "cpu_extension.py"
    path.write_text("def build(stop):\n    stop.wait()\n")
    spec = importlib.util.spec_from_file_location("cpu_extension_for_the_watch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stop = threading.Event()
    threading.Timer(0.8, stop.set).start()
    with watch.running("tests/test_x.py::test_first_engine"):
        module.build(stop)
    assert len(said) == 1 and "waiting for the C++ kernels to build or load" in said[0], said
    assert "a wait, not a loop" in said[0] and "may never end" not in said[0], said[0]


@pytest.mark.skipif(INTERRUPT is None, reason="the watch stops a test with a signal (POSIX)")
def test_a_test_where_an_earlier_one_got_stuck_fails_at_its_mark(course):
    module, watch, said, root = course
    path = str(root / "loops_for_the_watch.py")
    where = watch.got_stuck(
        "tests/test_x.py::test_first", [("pytest.py", 1, "main"), (path, 3, "spin"), (path, 6, "step")]
    )
    assert where == "stages/loops_for_the_watch.py:3 in spin > :6 in step", where

    start = time.monotonic()
    with pytest.raises(StuckTest) as failed:  # a BaseException: no `except Exception` in the test catches it
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


@pytest.mark.skipif(INTERRUPT is None, reason="the watch stops a test with a signal (POSIX)")
def test_a_test_that_catches_its_time_limit_is_stopped_for_good(course):
    module, watch, _, _ = course
    start = time.monotonic()
    with pytest.raises(StuckTest) as stopped:
        with watch.running("tests/test_x.py::test_property", limit_s=0.5):
            while True:  # hypothesis' way with a failing example: run it again
                try:
                    module.spin(threading.Event())  # never returns
                except Exception:
                    continue
    took = time.monotonic() - start
    assert stopped.value.limit_s == 0.5 and 0.7 < took < 5, (
        f"a test still running one mark (0.3 s) past its 0.5 s limit is stopped with StuckTest; took {took:.1f} s"
    )


WATCHED = """
import pytest, pytest_timeout
from stuck_watch import StuckWatch

def pytest_configure(config):
    config.stuck_watch = StuckWatch([], config.rootpath, after_s=1.0, say=None)

@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    limit = pytest_timeout.get_env_settings(item.config).timeout
    with item.config.stuck_watch.running(item.nodeid, limit_s=limit):
        return (yield)
"""

PROPERTY = """
from hypothesis import given, settings, strategies as st

@settings(max_examples=5, deadline=None, database=None)
@given(st.integers())
def test_loops(n):
    while True:
        pass

def test_after():
    assert True
"""


@pytest.mark.skipif(INTERRUPT is None, reason="the watch stops a test with a signal (POSIX)")
def test_a_property_test_stuck_in_a_loop_fails_once_instead_of_shrinking_forever(tmp_path):
    # pytest-timeout fails the example; hypothesis catches that and runs it again to shrink it,
    # which without the watch's backstop never ends (no second timer)
    (tmp_path / "conftest.py").write_text(WATCHED)
    (tmp_path / "test_property.py").write_text(PROPERTY)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTEST_TIMEOUT": "2"}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbval", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert "1 failed, 1 passed" in done.stdout and took < 60, (
        f"the looping property test should fail once and the run go on ({took:.0f} s):\n{done.stdout[-2000:]}"
    )
    assert "StuckTest" in done.stdout, done.stdout[-2000:]


NESTED = """
import functools

def plain():
    pass

class Pool:
    @functools.lru_cache(maxsize=None)
    def alloc(self):
        def helper():
            return 1
        return helper()

    class Inner:
        async def wait(self):
            pass
"""


def test_python_3_10_reads_qualified_names_from_the_source(tmp_path):
    # Python 3.10 has no co_qualname: the watch and the "not written yet" note read Class.method
    # from the file instead, so a learner there sees the names a learner on 3.11+ sees.
    path = tmp_path / "nested.py"
    path.write_text(NESTED)
    lines = NESTED.splitlines()
    at = {text.strip(): number for number, text in enumerate(lines, start=1)}
    expected = {
        ("pass", "plain"): "plain",
        ("return helper()", "alloc"): "Pool.alloc",
        ("return 1", "helper"): "Pool.alloc.<locals>.helper",
        ("@functools.lru_cache(maxsize=None)", "alloc"): "Pool.alloc",  # a decorated function starts there
        ("async def wait(self):", "wait"): "Pool.Inner.wait",
        ("return 1", "not_there"): "not_there",
    }
    for (text, function), qualname in expected.items():
        got = qualname_from_source(str(path), at[text], function)
        assert got == qualname, f"{function} at {text!r}: {got!r}, expected {qualname!r}"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="compares with co_qualname (Python 3.11+)")
def test_the_names_read_from_the_source_are_pythons_own():
    from s04_paged_kv_pool import allocator
    from s06_radix_cache import radix_cache

    compared = 0
    for module in (allocator, radix_cache):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            for function in vars(cls).values():
                code = getattr(function, "__code__", None)
                if code is None or code.co_filename != module.__file__:
                    continue
                got = qualname_from_source(code.co_filename, code.co_firstlineno, code.co_name)
                assert got == code.co_qualname, (
                    f"{code.co_filename}:{code.co_firstlineno}: {got!r} != {code.co_qualname!r}"
                )
                compared += 1
    assert compared >= 10, f"only {compared} methods compared"
