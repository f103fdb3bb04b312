"""Shared test setup: the implementation switch, tiny models, the default model, HF references.

The switch is installed before anything imports an engine package, so every test runs the
tree selected by ENGINE_IMPL (see tools/impl_switch.py). Tests under tests/stageNN/ are the
graded tests of stage N and get the ``stage(N)`` marker from their folder.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import pytest_timeout

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))

import impl_switch  # noqa: E402

IMPL_CHOSEN = "ENGINE_IMPL" in os.environ  # before install(), which sets it for child processes
SWITCH = impl_switch.install()

from stuck_watch import StuckWatch, frame_of, frames_of, location, make_watch, timed_out_after  # noqa: E402
from tiny_models import FAMILIES, build_tiny_model  # noqa: E402

STAGE_DIR = re.compile(r"stage(\d\d)$")


def pytest_report_header(config):
    return SWITCH.describe()


STUCK_WATCH = pytest.StashKey[StuckWatch]()


def pytest_configure(config):
    roots = [Path(p).resolve() for p in (SWITCH.stages_dir, SWITCH.solutions_dir)]
    config.stash[STUCK_WATCH] = make_watch(config, roots, REPO)


def time_limit(item) -> float | None:
    """The test's time limit (pytest-timeout's: its marker, else PYTEST_TIMEOUT or pyproject.toml)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0]) or None
    return pytest_timeout.get_env_settings(item.config).timeout or None


def servers_of(item) -> list:
    """The running servers a test uses as fixtures (stage 9's ``Server``, also in stages 10 and 11)."""
    servers = [value for value in getattr(item, "funcargs", {}).values() if hasattr(value, "check_answering")]
    return list({id(server): server for server in servers}.values())  # a session's fixture and the test's: one


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Each test's call under the stuck watch (stuck_watch.py): said at its mark, stopped if it is
    where an earlier test got stuck. A server that left an earlier test waiting in vain must first
    answer a one-token request (Server.check_answering), or the test fails at once."""
    for server in servers_of(item):
        server.check_answering()
        server.mark_log()
    takes = item.get_closest_marker("takes")
    with item.config.stash[STUCK_WATCH].running(item.nodeid, takes.args[0] if takes else 0, time_limit(item)):
        return (yield)


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        match = STAGE_DIR.match(folder)
        if match:
            item.add_marker(pytest.mark.stage(int(match.group(1))))
        if folder == "gpu":
            item.add_marker(pytest.mark.gpu)


# exercise (where, what) -> the tests that stopped at it, for the summary at the end of the run
NOT_WRITTEN = pytest.StashKey[dict[tuple[str, str], set[str]]]()
EARLIER_STAGE_HINTS = pytest.StashKey[set[str]]()
EXERCISE_STAGE = re.compile(r"Stage (\d+):")


def exercise_location(excinfo) -> str:
    """Where the skeleton raised."""
    return location(frame_of(excinfo.traceback[-1]), REPO)


def unwritten_exercise(excinfo) -> pytest.ExceptionInfo | None:
    """The skeleton's ``NotImplementedError("Stage N: ...")`` that stopped a test, also where
    another exception carries it: NotImplementedError is a RuntimeError, so a test's
    ``pytest.raises(RuntimeError, match=...)`` catches it, and its failed match holds it as context."""
    error, seen = excinfo.value, set()
    while error is not None and id(error) not in seen:
        if isinstance(error, NotImplementedError) and str(error).startswith("Stage "):
            return pytest.ExceptionInfo.from_exception(error)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def unwritten_in_a_server(item) -> tuple[str, str] | None:
    """An exercise not written yet that raised in a server the test used, while it ran: (where,
    its message), from the server's log."""
    for server in servers_of(item):
        found = server.unwritten_exercise()
        if found is not None:
            frame, message = found
            return location(frame, REPO), message
    return None


def remember_unwritten(item, where: str, message: str) -> tuple[str, bool]:
    """Note that the exercise at ``where`` stopped ``item``, for the summary at the end. Returns
    its earlier-stage hint ("" if none) and whether an earlier test already stopped there."""
    hint = earlier_stage_hint(item, message)
    waiting = item.config.stash.setdefault(NOT_WRITTEN, {})
    said_before = (where, message) in waiting
    waiting.setdefault((where, message), set()).add(item.nodeid)
    if hint:
        item.config.stash.setdefault(EARLIER_STAGE_HINTS, set()).add(hint)
    return hint, said_before


def earlier_stage_hint(item, message: str) -> str:
    """For an exercise of an earlier stage than the test's: how to test this stage without it."""
    marker, found = item.get_closest_marker("stage"), EXERCISE_STAGE.match(message)
    if marker is None or found is None or int(found.group(1)) >= marker.args[0]:
        return ""
    stage, earlier = marker.args[0], int(found.group(1))
    return (
        f"\n   (stage {earlier} comes before stage {stage}: finish it, or test stage {stage} on the "
        f"reference stages 1-{stage - 1}: make stage-{stage} REFERENCE_UPTO={stage - 1})"
    )


def say_with(report, title: str, text: str, headline: str | None = None) -> None:
    """Add ``text`` to a failure's report, under ``title`` after its traceback, and ``headline``
    (if given) before the failure's message on its summary line (pytest's last lines, JUnit's
    message). The report stays pytest's own: a string in its place would leave the summary line
    without the failure's message, the line a learner reads first."""
    report.sections.append((title, text))
    crash = getattr(report.longrepr, "reprcrash", None)
    if headline is not None and crash is not None:
        crash.message = f"{headline}: {crash.message}"
    elif headline is not None:
        report.longrepr = f"{headline}\n{report.longrepr}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A stage exercise not written yet fails with where and what to write instead of a traceback;
    a test stopped by the timeout starts with where the course's code was running when it stopped;
    one that waited in vain for a server's answer says so first (and its server is asked next time)."""
    report = yield
    if call.when == "call" and call.excinfo is not None:
        # What a server said is in its log, not in the test's traceback (a connection error, a 500):
        # a server that died during the test says so first, any other points at its log.
        servers = servers_of(item)
        for server in servers:
            died, note = server.failure_note()
            say_with(report, "the server", note, headline=died)
        waited = [server.note_failure(item.nodeid, call.excinfo.value) for server in servers]
        if any(waited):
            say_with(
                report,
                "no answer",
                "a request to the server got no answer in time. Does every request reach the engine, and do its "
                "outputs go back through the detokenizer? The next test on this server first checks that it "
                "answers a one-token request.",
                headline="no answer in time",
            )
    limit = timed_out_after(call.excinfo.value) if call.excinfo is not None else None
    if limit is not None:
        where = item.config.stash[STUCK_WATCH].got_stuck(item.nodeid, frames_of(call.excinfo))
        running = f"; when it was stopped, it was running {where}" if where else ""
        say_with(
            report,
            "stuck",
            f"stuck: the test ran past {limit:g} s{running}. A loop that never ends? The traceback above ends "
            "where it was (PYTEST_TIMEOUT=SECONDS changes the limit; a later test found in the same place is "
            "stopped at its ENGINE_STILL_RUNNING_S mark instead).",
            headline=f"stuck: ran past {limit:g} s",
        )
    unwritten = unwritten_exercise(call.excinfo) if call.excinfo is not None else None
    in_a_server = None if unwritten is not None or call.excinfo is None else unwritten_in_a_server(item)
    if in_a_server is not None:  # the test sees only its symptom (a 500, a cut stream): say the cause first
        where, message = in_a_server
        hint, _ = remember_unwritten(item, where, message)
        say_with(report, "not written yet", f"{where}\n-> {message}{hint}", headline=f"not written yet: {where}")
    if unwritten is not None:
        message = str(unwritten.value)
        where = exercise_location(unwritten)
        hint, said_before = remember_unwritten(item, where, message)
        if said_before:  # said in full at the first test that stopped there
            # (which may be printed below this one: errors in fixtures come before failures)
            report.longrepr = f"not written yet: {where} (what to write: the summary at the end)"
        else:
            report.longrepr = f"not written yet: {where}\n-> {message}{hint}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A test module that cannot be imported (a SyntaxError in your stage, say) shows the import
    from the test file on, without the frames of pytest's and Python's import machinery above it."""
    report = yield
    if report.failed:
        lines = str(report.longrepr).splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("tests/")), None)
        if start:
            errors = [line.removeprefix("E").strip() for line in lines[start:] if line.startswith("E ")]
            headline = f"import failed: {errors[-1] if errors else 'see below'}"
            report.longrepr = "\n".join([headline, *lines[start:]])
    return report


def pytest_terminal_summary(terminalreporter, config):
    """Which code was tested (pytest -q hides the header that says so), then each exercise that is
    not written yet once, with how many tests wait on it."""
    # A learner who runs pytest by hand tests the reference unless told otherwise, and all green
    # would look like their own code passing.
    hint = "" if IMPL_CHOSEN else " (the default; your own code: make stage-N, or ENGINE_IMPL=stages)"
    terminalreporter.write_line(f"{SWITCH.describe()}{hint}")
    pending = config.stash.get(NOT_WRITTEN, {})
    if not pending:
        return
    terminalreporter.section("exercises not written yet")
    for (where, message), tests in sorted(pending.items(), key=lambda entry: -len(entry[1])):
        terminalreporter.line(f"{len(tests):4d} test(s) stop at {where}")
        terminalreporter.line(f"       -> {message}")
    for hint in sorted(config.stash.get(EARLIER_STAGE_HINTS, set())):
        terminalreporter.line(hint.strip())


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_models")
    for family in FAMILIES:
        build_tiny_model(family, root / family)
    return root


@pytest.fixture(params=FAMILIES)
def tiny_model_dir(request, tiny_models_root) -> Path:
    """A tiny random model folder of each family in turn (llama, llama3, qwen2, qwen3, llama_gqa_bias)."""
    return tiny_models_root / request.param


@pytest.fixture(scope="session")
def cuda_device():
    """The GPU. Without one: a skip with the reason, or a failure under ENGINE_REQUIRE_GPU=1
    (`make test-gpu`), so a GPU run can never pass by skipping everything."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    reason = f"needs a CUDA GPU; torch {torch.__version__} sees none on this machine"
    if os.environ.get("ENGINE_REQUIRE_GPU") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct). Skipped when it is not set up, unless
    ENGINE_REQUIRE_DEFAULT_MODEL=1 (as in `make test`), where its absence is a failure."""
    from s00_foundation.paths import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:
        if os.environ.get("ENGINE_REQUIRE_DEFAULT_MODEL") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
