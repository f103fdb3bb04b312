"""What a learner sees when an exercise is not written yet (not graded).

Runs pytest on the real skeleton in stages/, as `make stage-4` does, and checks that the
failure names the file, line and function to write, that an earlier stage's exercise says how
to test this stage without it, that the summary lists each exercise once, that code which
does not import says why without pages of import machinery, that a test stuck in a loop
is announced at its mark, fails at the timeout naming the line it was running, and that the next
test stuck in the same function fails at its own mark, and that a failing test on a server says
what the server said without hiding the failure's own message.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from impl_switch import SWITCH_VARS

REPO = Path(__file__).resolve().parents[2]
LIMIT_VARS = ("PYTEST_TIMEOUT", "ENGINE_STILL_RUNNING_S")  # a learner's own settings must not change these runs


def learner_run(
    *tests: str,
    reference_upto: int = 0,
    stages_dir: Path | None = None,
    exit_code: int = 1,
    test_timeout_s: int | None = None,
    still_running_s: int | None = None,
    columns: int | None = None,
) -> str:
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS and k not in LIMIT_VARS}
    env.update(ENGINE_IMPL="stages", ENGINE_REFERENCE_UPTO=str(reference_upto))
    if columns is not None:  # a terminal this wide (pytest's summary lines are cut to the width)
        env["COLUMNS"] = str(columns)
    if stages_dir is not None:
        env["ENGINE_STAGES_DIR"] = str(stages_dir)
    if test_timeout_s is not None:
        env["PYTEST_TIMEOUT"] = str(test_timeout_s)
    if still_running_s is not None:
        env["ENGINE_STILL_RUNNING_S"] = str(still_running_s)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *tests, "-q", "--tb=short", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == exit_code, (
        f"pytest should exit {exit_code}, it exited {done.returncode}:\n{done.stdout[-3000:]}"
    )
    return done.stdout


def reference_with(tmp_path: Path, file: str, old: str, new: str) -> Path:
    """A stages folder holding the reference code with ``old`` replaced by ``new`` in ``file``."""
    stages = tmp_path / "stages"
    shutil.copytree(REPO / "solutions", stages, ignore=shutil.ignore_patterns("__pycache__", "s00_foundation"))
    path = stages / file
    code = path.read_text()
    assert code.count(old) == 1, f"{file} no longer holds {old!r} once"
    path.write_text(code.replace(old, new))
    return stages


def test_an_unwritten_exercise_names_its_file_line_and_function():
    out = learner_run("tests/stage04/test_allocator.py", reference_upto=3)
    assert "not written yet: stages/s04_paged_kv_pool/allocator.py:" in out, out[-3000:]
    assert "in TokenToKVPoolAllocator.alloc_extend\n-> Stage 4: " in out, out[-3000:]
    assert "REFERENCE_UPTO" not in out, "an exercise of the stage under test needs no hint about earlier stages"
    summary = out.split("exercises not written yet")[-1]
    assert "test(s) stop at stages/s04_paged_kv_pool/allocator.py:" in summary, out[-3000:]
    # Among the failures, the exercise's text in full once, then a pointer to the summary.
    failures = out.split("FAILURES")[1].split("exercises not written yet")[0]
    # The one-line task and the README section that holds the idea, a first hint and the folded recipe.
    task = "-> Stage 4: give every request the slots of its new positions, filling its last page first"
    assert failures.count(f"{task} - see stages/s04_paged_kv_pool/README.md#what-you-write") == 1, failures[:3000]
    assert "(what to write: the summary at the end)" in failures, failures[:3000]


def test_an_earlier_stages_exercise_says_how_to_test_without_it():
    out = learner_run("tests/stage04/test_static_batch.py::test_page_sizes_give_identical_tokens")
    assert "-> Stage 2: " in out, out[-3000:]
    assert "make stage-4 REFERENCE_UPTO=3" in out, out[-3000:]


def test_an_unwritten_exercise_caught_by_a_tests_pytest_raises_is_still_named():
    """NotImplementedError is a RuntimeError: a test expecting a RuntimeError of its own catches
    the skeleton's, and its failed match must still read as the exercise not written yet."""
    test = "tests/stage10/test_overlap_hard_cases.py::test_a_failed_forward_under_overlap_leaves_nothing_untrusted"
    out = learner_run(f"{test}[1]", reference_upto=9)
    assert "not written yet: stages/s10_overlap_scheduling/scheduler.py:" in out, out[-3000:]
    assert "Regex pattern did not match" not in out, out[-3000:]


def test_a_syntax_error_in_your_stage_is_short_and_named(tmp_path):
    stages = tmp_path / "stages"
    shutil.copytree(REPO / "stages", stages, ignore=shutil.ignore_patterns("__pycache__"))
    with (stages / "s01_naive_generate" / "generate.py").open("a") as f:
        f.write("\ndef oops(:\n")
    done = learner_run("tests/stage01", stages_dir=stages, exit_code=2)  # 2: interrupted by a collection error
    assert "import failed: SyntaxError" in done, done[-3000:]
    assert "s01_naive_generate/generate.py" in done, done[-3000:]
    assert "importlib" not in done, f"the import machinery's frames should be cut:\n{done[-3000:]}"


def test_a_stuck_test_is_announced_fails_and_the_next_one_there_fails_sooner(tmp_path):
    """A loop that never ends (here: a lock that never walks up to the root) is announced at its
    mark, stops its test at the timeout, with the line of the learner's code it was running, and
    the next test stuck in the same function stops at its own mark (tests/stuck_watch.py)."""
    stages = reference_with(tmp_path, "s06_radix_cache/radix_cache.py", "            node = node.parent\n", "")
    first = "tests/stage06/test_radix_tree.py::test_locked_nodes_survive_eviction_and_lru_goes_first"
    second = "tests/stage06/test_radix_tree.py::test_an_unlock_without_a_matching_lock_raises_and_changes_nothing"
    out = learner_run(first, second, "--durations=0", stages_dir=stages, test_timeout_s=10, still_running_s=2)
    assert f"[still running after 2 s] {first}; now in " in out, out[-3000:]
    assert "stuck: the test ran past 10 s; when it was stopped, it was running" in out, out[-3000:]
    assert "s06_radix_cache/radix_cache.py:" in out and "in RadixCache._update_lock" in out, out[-3000:]
    # The second test loops in the same function: stopped at its 2-second mark, not at 10 s.
    assert "stuck again: still running after 2 s in " in out and f"where {first} got stuck before" in out, out[-3000:]
    took = re.search(rf"([\d.]+)s call +{re.escape(second)}", out)
    assert took is not None and float(took.group(1)) < 8, (
        f"the second stuck test should stop at its 2 s mark, well before the 10 s limit: {out[-1500:]}"
    )


def test_a_server_that_dies_during_a_test_says_so_first_with_its_error(tmp_path):
    """A scheduler that raises ends the server; openai's client says only 'Connection error' or a
    500. The failure's summary line starts with the server's exit, and the report shows the
    server's error lines."""
    stages = reference_with(
        tmp_path,
        "s09_zmq_serving/scheduler_process.py",
        "self.send_outputs(self.run_batch())\n",
        "self.send_outputs(self.run_batch(), 1)\n",
    )
    test = "tests/stage09/test_serving_openai.py::test_models_lists_the_served_model"
    out = learner_run(test, stages_dir=stages, columns=400)
    assert f"FAILED {test} - the server on llama exited (code 1) during this test: " in out, out[-3000:]
    section = out[out.index(" the server ---") :]
    assert "TypeError: SchedulerProcess.send_outputs() takes 2 positional arguments" in section, out[-3000:]


def test_a_failure_on_a_live_server_keeps_its_message_and_names_the_servers_log(tmp_path):
    """The server's log is named after the traceback; the summary line still says what failed
    (a note put in place of pytest's report left that line with the note instead)."""
    stages = reference_with(
        tmp_path,
        "s09_zmq_serving/scheduler_process.py",
        "self.send_to_detokenizer.send_pyobj(ErrorOut.refused(req.rid, error))",
        "self.send_to_detokenizer.send_pyobj(ErrorOut(req.rid, str(error), 400))",
    )
    test = "tests/stage09/test_serving_errors.py::test_bad_input_gets_an_openai_error_and_the_server_keeps_serving"
    # (the one case the engine itself refuses as too long: a prompt past the context is the tokenizer's)
    out = learner_run(f"{test}[prompt plus max_tokens beyond the context]", stages_dir=stages, columns=400)
    said = " - AssertionError: prompt plus max_tokens beyond the context: the engine refused it as too long"
    assert said in out, out[-3000:]
    section = out[out.index(" the server ---") :]
    assert "its log, with any traceback from its processes: " in section, out[-3000:]


@pytest.mark.parametrize(
    "file, before, function",
    [
        ("api_server.py", "    # BEGIN EXERCISE: the stream's chunks", "stream_chunks"),
        (
            "scheduler_process.py",
            "        # BEGIN EXERCISE: add a tokenized request to the engine",
            "SchedulerProcess.handle_generate_request",
        ),
    ],
    ids=["in the API server", "a method, in the scheduler"],
)
def test_an_exercise_not_written_in_a_server_is_named_as_the_cause(tmp_path, file, before, function):
    """An exercise left unwritten raises in a server's process (the API server's stream_chunks, the
    scheduler's handle_generate_request): the test sees only a stream cut short or a 500. The
    summary line starts with the exercise's place, read from the server's log, with a method's
    class as in a test that calls it directly, and the end-of-run list of exercises not written
    yet holds it."""
    indent = before[: len(before) - len(before.lstrip())]
    stages = reference_with(
        tmp_path,
        f"s09_zmq_serving/{file}",
        before,
        f"{indent}raise NotImplementedError('Stage 9: planted by this test')\n{before}",
    )
    test = "tests/stage09/test_serving_openai.py::test_a_stream_has_a_usage_chunk_only_when_asked[chat]"
    out = learner_run(test, reference_upto=8, stages_dir=stages, columns=400)
    where = f"{stages / 's09_zmq_serving' / file}:"
    assert f"FAILED {test} - not written yet: {where}" in out, out[-3000:]
    summary = out[out.index(" exercises not written yet ") :]
    assert re.search(rf"1 test\(s\) stop at {re.escape(where)}\d+ in {re.escape(function)}\n", summary), out[-3000:]
    assert "-> Stage 9: planted by this test" in summary, out[-3000:]
