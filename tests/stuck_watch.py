"""A test stuck in a loop: said within seconds, and not waited for again.

pytest-timeout (``timeout`` in pyproject.toml) fails a test that runs past its limit, so a loop
that never ends cannot hold a run forever. Alone it is slow to say so: a learner whose loop
forgets to stop saw nothing for five minutes, then the same five minutes for every other test
that calls that loop (17 tests of stage 1: 85 minutes of silence). So every test is watched:

- after ``ENGINE_STILL_RUNNING_S`` seconds (default 30) a test still running is announced on the
  terminal with the line of the course's code it is in, so Ctrl-C can come at once;
- once a test got stuck, the innermost function of the course's code it was in is remembered
  (when it was stopped, and at its mark); a later test found in one of those at its own mark
  fails there as stuck again, without waiting out the limit a second time.

"The course's code" is the learner's (stages/) when the stack holds any of it, else the reference
(solutions/). Where a test is, is looked at a few times at its mark, because a loop spends its
time in several functions (a generate loop and the forward it calls). Only the innermost is
compared: a correct test that is merely slow has the same outer frames as a stuck one.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

import pytest

SAMPLES = 5  # looks at the stack, SAMPLE_GAP_S apart: a loop moves between its functions
SAMPLE_GAP_S = 0.05
INTERRUPT = getattr(signal, "SIGUSR2", None)  # how the watch stops the main thread (POSIX only)

TIMED_OUT = re.compile(r"Timeout \(>([\d.]+)s\) from pytest-timeout")

Frame = tuple[str, int, str]  # (file, line, function)

# Places where a test waits on something else, not in a loop of its own: said as such at the mark.
WAITS = (
    ("ServerProcess.wait_ready", "waiting for its server to start"),
    ("cpu_extension.py", "waiting for the C++ kernels to build or load (one process at a time does)"),
)


class StuckTest(BaseException):
    """How the watch stops a test: a BaseException, so that neither the code under test (an
    ``except Exception``) nor hypothesis, which takes pytest's ``Failed`` for a failing example
    and runs the test again to shrink it, can catch it and go on. pytest reports it as a failure.
    ``limit_s``: the time limit the test had passed, None for one stopped at its mark."""

    def __init__(self, message: str, limit_s: float | None = None):
        super().__init__(message)
        self.limit_s = limit_s


def timed_out_after(error: BaseException) -> float | None:
    """The limit a test was stopped at (``timeout`` in pyproject.toml), by pytest-timeout or by the
    watch's backstop, or None."""
    if isinstance(error, StuckTest):
        return error.limit_s
    found = TIMED_OUT.match(str(error)) if isinstance(error, pytest.fail.Exception) else None
    return float(found.group(1)) if found else None


def qualified(filename: str, line: int, function: str) -> str:
    """``function`` as ``Class.method``. Python 3.11+ names it so itself (``co_qualname``); on 3.10
    it is read from the source: the innermost function of that name around ``line``. A learner sees
    the same names on every Python the course runs on."""
    return function if sys.version_info >= (3, 11) else qualname_from_source(filename, line, function)


def qualname_from_source(filename: str, line: int, function: str) -> str:
    """The qualified name of the innermost function called ``function`` around ``line`` of a file
    (``function`` itself if there is none)."""
    around = [(start, name) for start, end, name in functions_in(filename) if start <= line <= end]
    named = [start_name for start_name in around if start_name[1].rsplit(".", 1)[-1] == function]
    return max(named)[1] if named else function


@functools.lru_cache(maxsize=None)
def functions_in(filename: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function in a Python file; its first line
    is its first decorator's, as in its code object. Empty for a file that cannot be read."""
    try:
        tree = ast.parse(Path(filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno, *(decorator.lineno for decorator in child.decorator_list)])
                found.append((start, child.end_lineno or child.lineno, prefix + child.name))
                visit(child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def location(frame: Frame, repo: Path) -> str:
    """'stages/s04_.../allocator.py:84 in TokenToKVPoolAllocator.alloc_extend' (relative to ``repo``)."""
    filename, line, function = frame
    path = Path(filename).resolve()
    shown = path.relative_to(repo) if path.is_relative_to(repo) else path
    return f"{shown}:{line} in {qualified(filename, line, function)}"


def course_frames(frames: Iterable[Frame], roots: list[Path], repo: Path) -> list[tuple[str, Frame]]:
    """The frames of ``frames`` (outermost first) in the first of ``roots`` that holds any, each as
    its ``location`` and the frame (its file resolved), outermost first."""
    frames = [(str(Path(filename).resolve()), line, function) for filename, line, function in frames]
    for root in roots:
        inside = [
            (path, line, qualified(path, line, function))
            for path, line, function in frames
            if Path(path).is_relative_to(root)
        ]
        if inside:
            return [(location(frame, repo), frame) for frame in inside]
    return []


def innermost(found: list[tuple[str, Frame]]) -> set[tuple[str, str]]:
    """The innermost course frame's (file, function), as a set (empty if there is none). Only that
    one is compared: an outer one (a generate loop) is on the stack of every test, stuck or not."""
    return {(found[-1][1][0], found[-1][1][2])} if found else set()


def waiting_for(found: list[tuple[str, Frame]]) -> str | None:
    """What a test found in one of the WAITS is waiting for, else None."""
    for _, (path, _, function) in found:
        for mark, what in WAITS:
            if function.endswith(mark) or path.endswith(mark):
                return what
    return None


def call_path(found: list[tuple[str, Frame]]) -> str:
    """'stages/s01_.../generate.py:43 in naive_generate > :26 in next_token_logits': where a test is,
    the outermost course frame first (a loop is in one of them); a file named once."""
    parts, last_file = [], None
    for shown, (path, _, _) in found:
        parts.append(shown if path != last_file else shown[shown.rindex(":") :])
        last_file = path
    return " > ".join(parts)


def stack_of(thread_id: int) -> list[Frame]:
    """The frames a running thread is in now, outermost first."""
    frame = sys._current_frames().get(thread_id)
    frames: list[Frame] = []
    while frame is not None:
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name)))
        frame = frame.f_back
    return frames[::-1]


class StuckWatch:
    """Watches each test's call on a thread of its own (see the module docstring)."""

    def __init__(self, roots: list[Path], repo: Path, after_s: float, say: Callable[[str], None] | None):
        self.roots, self.repo, self.after_s, self.say = roots, repo, after_s, say
        self.stuck_in: dict[tuple[str, str], str] = {}  # (file, function) a test got stuck in -> that test
        self.seen: dict[str, set[tuple[str, str]]] = {}  # test -> where it was at its mark (kept if it gets stuck)
        self.failing: tuple[str, float | None] | None = None  # what the main thread raises when interrupted
        # Reentrant: the signal handler runs on the main thread, possibly while that thread holds it.
        self.lock = threading.RLock()
        if INTERRUPT is not None and threading.current_thread() is threading.main_thread():
            signal.signal(INTERRUPT, self.interrupted)

    def where(self, frames: Iterable[Frame]) -> list[tuple[str, Frame]]:
        return course_frames(frames, self.roots, self.repo)

    @contextmanager
    def running(self, nodeid: str, takes_s: float = 0, limit_s: float | None = None):
        """Around one test's call: the watch thread wakes at the mark unless the test ended.
        ``takes_s``: how long the test is known to take (``pytest.mark.takes``: a server that
        starts processes), if past the mark: then its mark is that much later. ``limit_s``: the
        test's time limit (pytest-timeout's), for the backstop (``watch``)."""
        ended = threading.Event()
        after_s = max(self.after_s, takes_s)
        thread = threading.Thread(
            target=self.watch,
            args=(nodeid, threading.get_ident(), ended, after_s, limit_s),
            name="stuck-watch",
            daemon=True,
        )
        thread.start()
        try:
            yield
        finally:
            with self.lock:
                ended.set()
                self.failing = None

    def watch(self, nodeid: str, thread_id: int, ended: threading.Event, after_s: float, limit_s: float | None) -> None:
        started = time.monotonic()
        self.at_mark(nodeid, thread_id, ended, after_s)
        if limit_s is None or INTERRUPT is None:
            return
        # The time limit fails a test once. Code that catches that failure and goes on would then
        # run unbounded: hypothesis does, taking it for a failing example that it runs again to
        # shrink. So a test still running one mark past its limit is stopped with StuckTest,
        # which nothing catches, and again at every mark after, until it ends.
        wait = started + limit_s + after_s - time.monotonic()
        while not ended.wait(max(wait, 0)):
            self.interrupt(
                thread_id,
                ended,
                f"stuck: still running {after_s:g} s after its time limit of {limit_s:g} s stopped it (the code it "
                "runs caught that and went on); stopped for good now. A loop that never ends?",
                limit_s,
            )
            wait = after_s

    def interrupt(self, thread_id: int, ended: threading.Event, message: str, limit_s: float | None = None) -> None:
        """Make the test's thread raise StuckTest(message) (unless it ended meanwhile)."""
        with self.lock:
            if ended.is_set():
                return
            self.failing = (message, limit_s)
            signal.pthread_kill(thread_id, INTERRUPT)

    def at_mark(self, nodeid: str, thread_id: int, ended: threading.Event, after_s: float) -> None:
        """At the mark: stop a test found where an earlier one got stuck, else say where it is."""
        if ended.wait(after_s):
            return
        places: set[tuple[str, str]] = set()  # the innermost course function of each look
        path_now, waiting = "", None
        for _ in range(SAMPLES):
            found = self.where(stack_of(thread_id))
            places |= innermost(found)
            path_now = call_path(found) or path_now
            waiting = waiting_for(found) or waiting
            if ended.wait(SAMPLE_GAP_S):
                return
        self.seen[nodeid] = places
        again = next((place for place in places if place in self.stuck_in), None)
        if again is not None and INTERRUPT is not None:
            self.interrupt(
                thread_id,
                ended,
                f"stuck again: still running after {after_s:g} s in {path_now}, where "
                f"{self.stuck_in[again]} got stuck before; stopped now instead of at the time limit. "
                "A loop that never ends? (If it is only slow: ENGINE_STILL_RUNNING_S=SECONDS.)",
            )
        elif self.say is not None:
            if waiting is not None:
                now = f", {waiting} ({path_now}): a wait, not a loop, as long as it ends"
            elif path_now:
                now = f"; now in {path_now}. Most tests take seconds: if this one goes on, a loop may never end"
            else:  # e.g. a stage 9 test waiting for its server, whose code runs in other processes
                now = ", waiting outside this process's course code (for a server's answer, say)"
            self.say(
                f"\n[still running after {after_s:g} s] {nodeid}{now} (Ctrl-C stops the run; the test fails "
                "at its time limit).\n"
            )

    def interrupted(self, signum, frame) -> None:
        """In the main thread: stop the test the watch found stuck (if it is still running)."""
        __tracebackhide__ = True  # the test's traceback ends in its own code, not here
        with self.lock:
            failing, self.failing = self.failing, None
        if failing is not None:
            raise StuckTest(*failing)

    def got_stuck(self, nodeid: str, frames: Iterable[Frame]) -> str | None:
        """A test stopped by the time limit: remember where it was (its innermost course function
        then and at its mark); returns its call path, None if it was in no course code."""
        found = self.where(frames)
        places = self.seen.pop(nodeid, set()) | innermost(found)
        for place in places:
            self.stuck_in.setdefault(place, nodeid)
        return call_path(found) or None


def terminal_writer() -> Callable[[str], None]:
    """Write to the terminal from any thread, past pytest's capture of the test's output: a copy
    of stdout's descriptor taken before any test runs (capture redirects the descriptor itself)."""
    fd = os.dup(1)

    def write(text: str) -> None:
        os.write(fd, text.encode(errors="replace"))

    return write


def seconds_from_env(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        seconds = float(value) if value else default
    except ValueError:
        seconds = -1.0
    if not seconds > 0:  # also NaN
        raise pytest.UsageError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def make_watch(config, roots: list[Path], repo: Path) -> StuckWatch:
    """The session's watch; it announces only where a terminal reads this process's output (not in
    a pytest-xdist worker, whose output nobody sees)."""
    after_s = seconds_from_env("ENGINE_STILL_RUNNING_S", 30.0)
    worker = hasattr(config, "workerinput")
    return StuckWatch(roots, repo, after_s, None if worker else terminal_writer())


def frame_of(entry) -> Frame:
    """A pytest traceback entry as a ``Frame`` (its function by qualified name where Python has one)."""
    code = entry.frame.code.raw
    return str(entry.path), entry.lineno + 1, getattr(code, "co_qualname", code.co_name)


def frames_of(excinfo) -> list[Frame]:
    """A traceback's frames, outermost first."""
    return [frame_of(entry) for entry in excinfo.traceback]
