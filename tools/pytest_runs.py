"""Run pytest in a child process with chosen ENGINE_* settings and read what each test did.

Shared by prove_tests_fail.py and grade.py. Outcomes come from pytest's JUnit XML, so
nothing here depends on pytest's console output.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from impl_switch import SWITCH_VARS

REPO = Path(__file__).resolve().parent.parent
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}  # a test's worst phase decides


@dataclass
class Run:
    outcomes: dict[str, str]  # test id -> passed / failed / error / skipped
    returncode: int
    output: str
    timed_out: bool = False  # stopped at its time limit (what it had reported by then is lost)


def child_env(**switch: str) -> dict[str, str]:
    """This process's environment with only the given ENGINE_* settings (others unset)."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS}
    env.update({k: v for k, v in switch.items() if v is not None})
    return env


def read_junit(path: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test = f"{classname}::{name}" if classname else f"{name} (collecting the module)"
        outcome = "passed"
        for tag in ("skipped", "failure", "error"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        if RANK[outcome] >= RANK[outcomes.get(test, "passed")]:
            outcomes[test] = outcome
    return outcomes


def run_pytest(
    paths: list[str],
    env: dict[str, str],
    junit: Path | None = None,
    root: Path = REPO,
    extra: tuple[str, ...] = (),
    timeout_s: float | None = None,
) -> Run:
    """Run every test under `paths` (no -x: each test must run) and collect outcomes. Past
    ``timeout_s`` the run is interrupted as Ctrl-C would (pytest then writes its report of the
    tests that ran), and killed with every process it started (a server, a rank) if it is still
    there STOP_GRACE_S later: a loop the tests' own limits cannot stop (one at import time, in a
    fixture) holds no one forever. Ctrl-C here (the run's own session does not get the terminal's)
    kills the run and all it started, and goes on up as KeyboardInterrupt."""
    with contextlib.ExitStack() as stack:
        if junit is None:
            junit = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            *paths,
            "-p",
            "no:cacheprovider",
            "-q",
            "--continue-on-collection-errors",
            f"--junitxml={junit}",
            *extra,
        ]
        child = subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        timed_out = False
        try:
            output, _ = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            output = stop(child)
        except BaseException:
            kill(child)
            raise
        outcomes = read_junit(junit) if junit.is_file() else {}
    return Run(outcomes, child.returncode, output, timed_out)


STOP_GRACE_S = 30  # how long a run interrupted at its time limit has to write its report


def stop(child: subprocess.Popen) -> str:
    """Interrupt a run started in its own session (Ctrl-C: pytest ends the session and writes its
    report), kill it and everything it started if it is still there STOP_GRACE_S later; its output."""
    if hasattr(os, "killpg"):  # (Windows has no process groups: kill() alone)
        os.killpg(child.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.communicate(timeout=STOP_GRACE_S)
    kill(child)
    # All of its output, whichever way the wait above ended: communicate() keeps what it read
    # before a timeout, and once the process is done it returns the same output again.
    return child.communicate()[0]


def kill(child: subprocess.Popen) -> None:
    """Kill a run started in its own session and everything it started (a server, a rank)."""
    if not hasattr(os, "killpg"):
        child.kill()
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    child.wait()  # (no zombie left)


def collect(paths: list[str], env: dict[str, str], root: Path = REPO) -> list[str]:
    """Node ids pytest collects under `paths` (empty if collection breaks)."""
    command = [sys.executable, "-m", "pytest", *paths, "-p", "no:cacheprovider", "-q", "--collect-only"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    return [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def graded_test_dirs(root: Path = REPO) -> dict[int, Path]:
    """Stage N -> tests/stageNN, for each such folder that holds at least one test file."""
    return {
        int(folder.name[5:]): folder
        for folder in sorted((root / "tests").glob("stage[0-9][0-9]"))
        if any(folder.rglob("test_*.py")) or any(folder.rglob("*_test.py"))
    }


def stage_of(test: str) -> int | None:
    """The stage a test id belongs to, from its tests/stageNN folder."""
    match = re.search(r"(?:^|[./])stage(\d\d)(?:[./:]|$)", test)
    return int(match.group(1)) if match else None


def parse_stages(text: str) -> set[int]:
    """'1-4' or '1,3,5-6' -> {1, 2, 3, 4} ... (argparse shows the ArgumentTypeError's message)."""
    stages: set[int] = set()
    for part in filter(None, text.replace(" ", "").split(",")):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            first = last = -1
        if not 0 <= first <= last:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a stage or a range of stages: give numbers and ranges, e.g. 4, 1-4 or 1,3,5-6"
            )
        stages.update(range(first, last + 1))
    return stages
