"""The fail-proof and the grader, on a tiny course made here (not graded).

The tiny course has stage 1 (one honest test, one that passes on the skeleton, one that
skips), stage 2 (one honest test) and stage 3 (no tests yet).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
CONFTEST = f"""
import sys
sys.path.insert(0, {str(TOOLS)!r})
import impl_switch
SWITCH = impl_switch.install()
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("course")
    # nbval off, as in the course's own settings: it would add ~2 s to each of the many pytest runs here
    write(root / "pyproject.toml", '[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "-p no:nbval"\n')
    write(root / "solutions" / "s00_foundation" / "__init__.py", "ONE = 1\n")
    write(root / "solutions" / "s01_add" / "README.md", "# add\n")
    write(
        root / "solutions" / "s01_add" / "__init__.py",
        """\
        def add(a, b):
            # BEGIN EXERCISE: return the sum
            return a + b
            # END EXERCISE


        def double(a):
            return 2 * a
        """,
    )
    write(root / "solutions" / "s02_mul" / "README.md", "# mul\n")
    write(
        root / "solutions" / "s02_mul" / "__init__.py",
        """\
        from s01_add import add


        def mul(a, b):
            # BEGIN EXERCISE: multiply by repeated addition
            total = 0
            for _ in range(b):
                total = add(total, a)
            return total
            # END EXERCISE
        """,
    )
    write(root / "solutions" / "s03_later" / "__init__.py", "")
    write(root / "tests" / "conftest.py", CONFTEST)
    (root / "tests" / "stage03").mkdir()  # a folder whose tests are not written yet
    write(
        root / "tests" / "stage01" / "test_add.py",
        """\
        import pytest
        from s01_add import add, double


        def test_add():
            assert add(2, 3) == 5


        def test_double_is_not_an_exercise():
            assert double(2) == 4


        def test_skipped():
            pytest.skip("not on this machine")
        """,
    )
    write(
        root / "tests" / "stage02" / "test_mul.py",
        """\
        from s02_mul import mul


        def test_mul():
            assert mul(3, 4) == 12
        """,
    )
    return root


def tool(name: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def grade(course: Path, reports: Path, *args: str) -> subprocess.CompletedProcess:
    """tools/grade.py on the tiny course, its reports in ``reports``."""
    return tool("grade.py", "--root", str(course), "--junit-dir", str(reports), *args)


def test_prove_reports_tests_that_pass_or_skip_on_the_skeleton(course):
    done = tool("prove_tests_fail.py", "--root", str(course))
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "tests.stage01.test_add::test_double_is_not_an_exercise PASSED on the skeleton" in out
    assert "tests.stage01.test_add::test_skipped SKIPPED on the skeleton" in out
    assert "test_add::test_add " not in out, "an honest test is not a defect"
    assert "skipped: no tests in tests/stage03/ yet" in out
    assert "2 defect(s)" in out


def test_prove_accepts_honest_tests_and_checks_solutions_on_request(course):
    done = tool("prove_tests_fail.py", "--root", str(course), "--stages", "2-3", "--solutions")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: every test fails on the skeleton" in done.stdout
    done = tool("prove_tests_fail.py", "--root", str(course), "--stages", "1", "--solutions")
    assert "test_skipped SKIPPED on the solutions; it must pass there" in done.stdout


def test_grade_scores_each_checkout_and_writes_junit(course, tmp_path):
    finished, untouched, broken, empty = (tmp_path / n for n in ("finished", "untouched", "broken", "empty"))
    shutil.copytree(course / "solutions", finished / "stages")
    assert (
        tool(
            "make_skeleton.py", "--solutions", str(course / "solutions"), "--stages", str(untouched / "stages")
        ).returncode
        == 0
    )
    shutil.copytree(finished / "stages", broken / "stages")
    (broken / "stages" / "s02_mul" / "__init__.py").write_text("this is not python\n")
    empty.mkdir()
    reports = tmp_path / "reports"

    done = grade(course, reports, str(finished), str(untouched), str(broken), str(empty), f"{finished}/")
    assert done.returncode == 1, f"a checkout that could not be graded makes the exit status 1:\n{done.stdout}"
    assert f"{finished} is named 2 times: it is graded once" in done.stdout, done.stdout
    assert done.stdout.count(f"== {finished}\n") == 1 and not (reports / "finished-2.xml").exists(), done.stdout
    tables = {block.split("\n", 1)[0].strip(): block for block in done.stdout.split("== ")[1:]}

    def score(name, stage):
        row = next(line for line in tables[str(tmp_path / name)].splitlines() if line.split()[:1] == [str(stage)])
        return row.split()[1]

    assert (score("finished", 1), score("finished", 2), score("finished", "all")) == ("2/3", "1/1", "3/4")
    assert (score("untouched", 1), score("untouched", 2)) == ("1/3", "0/1")
    assert score("broken", 2) == "0/1", "a stage whose module does not import still counts its tests"
    broken_rows = tables[str(tmp_path / "broken")]
    assert "first error: NameError: name 'this' is not defined" in broken_rows, (
        f"a broken checkout should say why:\n{broken_rows}"
    )
    assert next(line for line in broken_rows.splitlines() if line.split()[:1] == ["2"]).split()[3] == "1", broken_rows
    assert "(at stages/s02_mul/__init__.py:1)" in broken_rows, f"the first error says where:\n{broken_rows}"
    assert "first error:" not in tables[str(tmp_path / "untouched")], "failing tests are not errors"
    assert (
        "stage 1, first failure: test_add::test_add: NotImplementedError: Stage 1: return the sum"
        in (tables[str(tmp_path / "untouched")])
    ), f"a stage whose tests ran and failed names its first failure:\n{tables[str(tmp_path / 'untouched')]}"
    assert "no stages/ folder" in tables[str(empty)]
    untouched_row = next(line for line in tables[str(untouched)].splitlines() if line.split()[:1] == ["1"])
    assert untouched_row.split()[2:6] == ["1", "0", "1", "1"], (
        f"untouched stage 1: 1 failed, 0 errors, 1 skipped, 1 unwritten (add is an exercise): {untouched_row}"
    )

    class_table = done.stdout.split("\ncheckout")[1].split("\n\n")[0]  # the class's table: a row per checkout
    class_rows = {line.split()[0]: line.split()[1:] for line in class_table.splitlines()[1:]}
    assert class_rows["finished"] == ["2/3", "1/1", "3/4"] and class_rows["broken"][1] == "0/1", class_rows
    assert class_rows["empty"][:2] == ["not", "graded:"], class_rows
    summary = json.loads((reports / "summary.json").read_text())
    by_name = {c["name"]: c for c in summary["checkouts"]}
    assert by_name["finished"]["stages"][0] | {"seconds": 0} == {
        "stage": 1,
        "total": 3,
        "passed": 2,
        "failed": 0,
        "errors": 0,
        "skipped": 1,
        "unwritten": 0,
        "seconds": 0,
        "problem": None,
        "first_error": None,
        "first_failure": None,
    }, by_name["finished"]
    assert "no stages/ folder" in by_name["empty"]["problem"]
    rows = list(csv.DictReader((reports / "summary.csv").open()))
    assert {(r["name"], r["stage"], r["passed"], r["total"]) for r in rows} >= {
        ("finished", "1", "2", "3"),
        ("broken", "2", "0", "1"),
    }, rows

    for name in ("finished", "untouched", "broken", "empty"):
        assert (reports / f"{name}.xml").is_file(), f"no JUnit report for {name}"
    cases = {c.get("name"): c for c in ET.parse(reports / "finished.xml").iter("testcase")}
    assert cases["test_add"].find("failure") is None and cases["test_skipped"].find("skipped") is not None
    assert ET.parse(reports / "empty.xml").find(".//error") is not None
    suites = {suite.get("name"): suite for suite in ET.parse(reports / "broken.xml").iter("testsuite")}
    assert list(suites) == ["stage01", "stage02"], f"a test suite per stage, named after it: {list(suites)}"
    stage2 = suites["stage02"]
    assert stage2.find("properties/property[@name='checkout']").get("value") == str(broken)
    mul = [case for case in stage2.iter("testcase") if case.get("classname") == "tests.stage02.test_mul"]
    assert len(mul) == 1 and mul[0].find("error").get("message").startswith("not run: its module did not import"), (
        "a test that never ran (its module did not import) is in the report as an error, as the table counts it"
    )
    tests = [case for case in stage2.iter("testcase") if case.get("classname")]  # (not the module's own error)
    assert len(tests) == 1 and stage2.get("errors") == str(len(list(stage2.iter("error")))), ET.tostring(stage2)


def test_isolated_grading_scores_each_stage_on_the_reference_before_it(course, tmp_path):
    # Stage 2 written, stage 1 not: cumulative scoring fails stage 2 (it calls the learner's add),
    # isolated scoring runs it on the reference stage 1 and credits it.
    half = tmp_path / "half"
    assert (
        tool("make_skeleton.py", "--solutions", str(course / "solutions"), "--stages", str(half / "stages")).returncode
        == 0
    )
    shutil.copy(course / "solutions" / "s02_mul" / "__init__.py", half / "stages" / "s02_mul" / "__init__.py")
    reports = tmp_path / "reports"

    def stage_scores(*flags):
        done = grade(course, reports, *flags, str(half))
        assert done.returncode == 0, done.stdout + done.stderr
        rows = [line.split() for line in done.stdout.splitlines()]
        return {row[0]: row[1] for row in rows if row[:1] in (["1"], ["2"])}

    assert stage_scores() == {"1": "1/3", "2": "0/1"}
    assert stage_scores("--isolated") == {"1": "1/3", "2": "1/1"}
    suites = ET.parse(reports / "half.xml").getroot().findall(".//testsuite")
    assert len(suites) == 2, "--isolated writes one report per checkout, with a test suite per stage"
    assert not list(reports.glob("half.stage*.xml")), "the per-stage parts are merged away"


def test_a_stage_that_never_ends_or_ends_its_process_or_a_missing_folder_costs_only_itself(course, tmp_path):
    # stage 2's module loops at import time, where no test's own limit reaches; isolated scoring
    # grades stage 1 anyway, and stage 2 is stopped at --stage-timeout with its test as an error,
    # said where it was. Another checkout's mul ends pytest's process: its test is named.
    looping, exits = tmp_path / "looping", tmp_path / "exits"
    shutil.copytree(course / "solutions", looping / "stages")
    (looping / "stages" / "s02_mul" / "__init__.py").write_text("while True:\n    pass\n")
    shutil.copytree(course / "solutions", exits / "stages")
    mul = exits / "stages" / "s02_mul" / "__init__.py"
    mul.write_text(mul.read_text().replace("    total = 0\n", "    import os\n\n    os._exit(0)\n    total = 0\n"))
    reports = tmp_path / "reports"
    started = time.monotonic()
    done = grade(
        course, reports, "--isolated", "--stage-timeout", "10", str(looping), str(exits), str(tmp_path / "nobody")
    )
    took = time.monotonic() - started
    assert done.returncode == 1 and took < 120, f"({took:.0f} s)\n{done.stdout}\n{done.stderr}"
    tables = {block.split("\n", 1)[0].strip(): block for block in done.stdout.split("== ")[1:]}
    rows = {
        line.split()[0]: line.split()[1:]
        for line in tables[str(looping)].splitlines()
        if line.split()[:1] in (["1"], ["2"])
    }
    assert rows["1"][0] == "2/3" and rows["2"][:3] == ["0/1", "0", "1"], rows
    assert re.search(
        r"stage 2's run was stopped after 10 s \(--stage-timeout\) at stages/s02_mul/__init__.py:\d", done.stdout
    ), f"a run stopped at its limit says where it was:\n{done.stdout}"
    assert (
        "stage 2's pytest exited 0 without a report, while tests/stage02/test_mul.py::test_mul ran"
        in tables[str(exits)]
    ), f"a run that ended its own process names the test it was running:\n{done.stdout}"
    assert "does not exist" in done.stdout, done.stdout
    summary = {c["name"]: c for c in json.loads((reports / "summary.json").read_text())["checkouts"]}
    assert "stopped after 10 s" in summary["looping"]["problem"] and "does not exist" in summary["nobody"]["problem"]
    for name, why in (
        ("looping", "not run: stage 2's run was stopped at its time limit"),
        ("exits", "not run: stage 2's"),
    ):
        errors = [case.find("error") for case in ET.parse(reports / f"{name}.xml").iter("testcase")]
        assert [error.get("message")[: len(why)] for error in errors if error is not None] == [why], name
    rows = [r for r in csv.DictReader((reports / "summary.csv").open()) if r["name"] == "nobody"]
    assert [(r["stage"], r["passed"], r["total"]) for r in rows] == [("1", "0", "3"), ("2", "0", "1")], (
        f"a checkout not graded has a row per stage with its total, so a sheet's sums hold it: {rows}"
    )


def test_ctrl_c_stops_the_grading_and_the_stages_run(course, tmp_path):
    """grade.py runs each stage's pytest in a session of its own (so a stopped run can be killed
    with all it started), which the terminal's Ctrl-C does not reach: grade.py must stop it."""
    looping = tmp_path / "looping"
    shutil.copytree(course / "solutions", looping / "stages")
    pid_file = tmp_path / "pytest.pid"
    (looping / "stages" / "s02_mul" / "__init__.py").write_text(
        f"import os\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    pass\n"
    )
    command = [sys.executable, str(TOOLS / "grade.py"), "--root", str(course), "--junit-dir", str(tmp_path / "r")]
    grading = subprocess.Popen(
        [*command, "--stages", "2", str(looping)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.is_file(), "stage 2's run never started"
    grading.send_signal(signal.SIGINT)
    out, _ = grading.communicate(timeout=30)
    assert grading.returncode == 130 and "interrupted: grading stopped" in out, out
    assert "Traceback" not in out, out
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # stage 2's pytest is gone (killed and reaped)


def test_a_checkout_that_changes_the_graders_files_stops_the_grading(course, tmp_path):
    """A learner's code runs with the grader's rights in its repository: a test file it wrote
    there (a conftest.py that passes everything, say) would change its own and every later
    checkout's score. The grader notices, says what changed, and grades no one after it."""
    writer, later = tmp_path / "writer", tmp_path / "later"
    shutil.copytree(course / "solutions", writer / "stages")
    shutil.copytree(course / "solutions", later / "stages")
    planted = course / "tests" / "stage01" / "planted.txt"
    add = writer / "stages" / "s01_add" / "__init__.py"
    add.write_text(f"open({str(planted)!r}, 'w').write('x')\n" + add.read_text())
    try:
        done = grade(course, tmp_path / "r", "--stages", "1", str(writer), str(later))
    finally:
        planted.unlink(missing_ok=True)
    assert done.returncode == 1, done.stdout
    assert "stage 1's run changed this repository's own files (added tests/stage01/planted.txt)" in done.stdout, (
        done.stdout
    )
    assert f"not graded: grading stopped: {writer}'s code changed this repository's own files" in done.stdout, (
        done.stdout
    )


def test_checkouts_of_the_same_folder_name_get_report_names_that_tell_them_apart():
    from grade import report_names

    checkouts = [Path("/class/alice/engine-course"), Path("/class/bob/engine-course"), Path("/class/carol/mine")]
    assert report_names(checkouts) == ["alice-engine-course", "bob-engine-course", "mine"]
    # whole paths that read the same once joined with "-": a number tells them apart
    same = [Path("/a-b/c"), Path("/z/c"), Path("/a/b-c"), Path("/y/b-c")]
    assert report_names(same) == ["a-b-c", "z-c", "a-b-c-2", "y-b-c"]


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--stages", "x", "'x' is not a stage or a range of stages: give numbers and ranges, e.g. 4, 1-4"),
        ("--stages", "3-1", "'3-1' is not a stage or a range of stages"),
        ("--stage-timeout", "0", "'0': give the seconds a stage's run may take, a number above 0"),
    ],
)
def test_a_wrong_option_says_what_is_allowed(course, tmp_path, flag, value, said):
    done = grade(course, tmp_path, flag, value)
    assert done.returncode == 2 and said in done.stderr, done.stdout + done.stderr
