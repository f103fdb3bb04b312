"""The fail-proof and the grader, on a tiny course made here (not graded).

The tiny course has stage 1 (one honest test, one that passes on the skeleton, one that
skips), stage 2 (one honest test) and stage 3 (no tests yet).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
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

    done = tool(
        "grade.py",
        "--root",
        str(course),
        "--junit-dir",
        str(reports),
        str(finished),
        str(untouched),
        str(broken),
        str(empty),
    )
    assert done.returncode == 0, done.stdout + done.stderr
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
    assert "first error:" not in tables[str(tmp_path / "untouched")], "failing tests are not errors"
    assert "no stages/ folder" in tables[str(empty)]

    for name in ("finished", "untouched", "broken", "empty"):
        assert (reports / f"{name}.xml").is_file(), f"no JUnit report for {name}"
    cases = {c.get("name"): c for c in ET.parse(reports / "finished.xml").iter("testcase")}
    assert cases["test_add"].find("failure") is None and cases["test_skipped"].find("skipped") is not None
    assert ET.parse(reports / "empty.xml").find(".//error") is not None


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
        done = tool("grade.py", "--root", str(course), "--junit-dir", str(reports), *flags, str(half))
        assert done.returncode == 0, done.stdout + done.stderr
        rows = [line.split() for line in done.stdout.splitlines()]
        return {row[0]: row[1] for row in rows if row[:1] in (["1"], ["2"])}

    assert stage_scores() == {"1": "1/3", "2": "0/1"}
    assert stage_scores("--isolated") == {"1": "1/3", "2": "1/1"}
    suites = ET.parse(reports / "half.xml").getroot().findall(".//testsuite")
    assert len(suites) == 2, "--isolated writes one report per checkout, with a test suite per stage"
    assert not list(reports.glob("half.stage*.xml")), "the per-stage parts are merged away"
