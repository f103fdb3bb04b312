"""Grade learners' checkouts with this repository's graded tests.

For each checkout, the graded tests tests/stageNN/ of *this* repository run against the
checkout's stages/ (ENGINE_IMPL=stages, ENGINE_STAGES_DIR=<checkout>/stages; the provided
s00_foundation always comes from solutions/), one pytest run per stage, each under a time limit
(--stage-timeout). So a checkout whose code does not import, or that loops where no test's own
limit reaches (at import time, in a fixture), costs that stage only: never its other stages, and
never the rest of the class.

Each checkout gets a JUnit XML report (a test suite per stage) and a table, a row printed as each
stage ends: passed/total, failed, errors, skipped, unwritten, seconds. "total" is the number of
tests the reference collects, so tests that never ran (their module does not import against the
learner's code, the stage's run was stopped) still count in full, as errors. "unwritten" counts
the failures at an exercise not written yet (the skeleton's NotImplementedError). Under the
table: each stage's first error, with where it was raised.

At the end: the class's table (a row per checkout, passed/total per stage), also written as
summary.csv and summary.json beside the JUnit files.

Two ways to score, both per stage:

    cumulative (default)  every stage runs on the learner's own earlier stages: stage N's score
                          says whether *their engine* does stage N (an unfinished stage 2 costs
                          points in every later stage)
    --isolated            stage N runs on the reference stages 1..N-1: the score is stage N's
                          own work, whatever came before

Exit status: 0 when every checkout was graded to the end; 1 when a checkout could not be graded
at all (no such folder, no stages/ in it) or a stage's run was stopped at its time limit or ended
without a report (its tests count as errors in the table; the line under it says why); 2 when
this repository's own tests do not collect.

    python tools/grade.py [CHECKOUT ...] [--junit-dir DIR] [--stages 1-4] [--isolated] [--stage-timeout S]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pytest_runs import REPO, child_env, collect, graded_test_dirs, parse_stages, run_pytest, stage_of

STAGE_TIMEOUT_S = 1200  # one stage's run: the reference's slowest (stage 9) takes a few minutes
# A skeleton's NotImplementedError("Stage N: ..."), as the course's conftest reports it or bare
UNWRITTEN = re.compile(r"not written yet|NotImplementedError: Stage \d+")
PYTHON_PLACE = re.compile(r'File "([^"]+)", line (\d+)')  # a Python traceback's line
PYTEST_PLACE = re.compile(r"^(\S+\.py):(\d+): ")  # pytest's short traceback line


@dataclass
class StageScore:
    stage: int
    total: int
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    unwritten: int = 0
    seconds: float = 0.0
    problem: str | None = None  # why the stage's run did not end normally (stopped, no report)
    first_error: str | None = None  # why its first test that could not run did not


def report_name(checkout: Path, taken: set[str]) -> str:
    """A file name for the checkout's report, unique among `taken`."""
    base = checkout.name or "checkout"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    taken.add(name)
    return name


def error_report(path: Path, message: str, details: str = "", name: str = "grade") -> None:
    """A JUnit file that says, machine-readably, why nothing (of a stage) was graded."""
    suite = ET.Element("testsuite", name=name, tests="1", errors="1", failures="0", skipped="0")
    case = ET.SubElement(suite, "testcase", classname=name, name="run")
    ET.SubElement(case, "error", message=message).text = details
    root = ET.Element("testsuites", name="grade")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def merge_reports(parts: list[Path], report: Path) -> None:
    """One JUnit file holding the test suites of several runs (the parts are removed)."""
    root = ET.Element("testsuites", name="grade")
    for part in parts:
        for suite in ET.parse(part).getroot().iter("testsuite"):
            root.append(suite)
        part.unlink()
    ET.ElementTree(root).write(report, encoding="utf-8", xml_declaration=True)


def where_raised(text: str, checkout: Path, root: Path) -> str:
    """' (at stages/s02_.../sampler.py:12)': the innermost place in a traceback's text (whose
    relative paths are from ``root``, where pytest ran), relative to the checkout when it is in it
    (a learner's file); '' if the text names none."""
    place = None
    for line in text.splitlines():
        line = line.removeprefix("E ").strip()
        found = PYTHON_PLACE.search(line) or PYTEST_PLACE.match(line)
        if found:
            place = (found.group(1), found.group(2))
    if place is None:
        return ""
    path = (root / place[0]).resolve()  # an absolute place stays as it is
    if path.is_relative_to(checkout):
        path = path.relative_to(checkout)
    return f" (at {path.as_posix()}:{place[1]})"


def first_error(report: Path, checkout: Path, root: Path) -> str | None:
    """The first error (not failure) in a JUnit report, in one line: why a test could not run,
    the exception (the last line of its traceback, e.g. a SyntaxError) and where it was raised."""
    for error in ET.parse(report).iter("error"):
        text = error.text or ""
        lines = [line.removeprefix("E ").strip() for line in text.splitlines() if line.strip()]
        what = lines[-1] if lines else error.get("message") or "(no message)"
        return (what[:300] + where_raised(text, checkout, root))[:400]
    return None


def unwritten_failures(report: Path) -> int:
    """Tests that stopped at an exercise not written yet."""
    return sum(
        UNWRITTEN.match(case.get("message") or "") is not None
        for case in ET.parse(report).iter()
        if case.tag in ("failure", "error")
    )


def grade_stage(
    checkout: Path, root: Path, n: int, tests: Path, reference_upto: int, part: Path, expected: int, timeout_s: float
) -> StageScore:
    """Stage N's graded tests on ``checkout`` (stages below ``reference_upto`` from the reference),
    its JUnit report in ``part``."""
    env = child_env(
        ENGINE_IMPL="stages",
        ENGINE_REFERENCE_UPTO=str(reference_upto),
        ENGINE_STAGES_DIR=str(checkout / "stages"),
        ENGINE_SOLUTIONS_DIR=str(root / "solutions"),
    )
    part.unlink(missing_ok=True)  # an earlier grading's, which a run that writes none would leave to be read
    start = time.perf_counter()
    run = run_pytest([str(tests)], env, junit=part, root=root, timeout_s=timeout_s)
    score = StageScore(n, expected, seconds=time.perf_counter() - start)
    if run.timed_out:
        score.problem = (
            f"stage {n}'s run was stopped after {timeout_s:g} s (--stage-timeout), its tests that had not run "
            "counted as errors: a loop that never ends where no test's own limit reaches (at import time, in a "
            "fixture)?"
        )
    elif not part.is_file():
        score.problem = f"stage {n}'s pytest exited {run.returncode} without a report" + where_raised(
            run.output, checkout, root
        )
    if not part.is_file():  # nothing to count: every test of the stage is an error
        error_report(part, score.problem or "no report", run.output[-5000:], name=f"stage{n:02d}")
        score.errors, score.first_error = expected, score.problem
        return score
    tests_run = {test: outcome for test, outcome in run.outcomes.items() if "::" in test}  # not module entries
    kinds = Counter(tests_run.values())
    score.total = max(expected, len(tests_run))
    score.passed, score.failed, score.skipped = kinds["passed"], kinds["failed"], kinds["skipped"]
    score.errors = kinds["error"] + (score.total - len(tests_run))  # a module that did not import: its tests
    score.unwritten = unwritten_failures(part)
    score.first_error = score.problem or first_error(part, checkout, root)  # a stopped run: its tests not run
    return score


def print_row(score: StageScore) -> None:
    print(
        f"   {score.stage:>5}  {f'{score.passed}/{score.total}':>12}  {score.failed:>6}  {score.errors:>6}  "
        f"{score.skipped:>7}  {score.unwritten:>9}  {score.seconds:>6.0f}",
        flush=True,
    )


def grade_checkout(
    checkout: Path,
    root: Path,
    test_dirs: dict[int, Path],
    stages: list[int],
    expected: Counter,
    report: Path,
    isolated: bool,
    timeout_s: float,
) -> list[StageScore]:
    """Every chosen stage on ``checkout``, printing its row as it ends; the stages' reports merged
    into ``report``."""
    print(
        f"   {'stage':>5}  {'passed/total':>12}  {'failed':>6}  {'errors':>6}  {'skipped':>7}  {'unwritten':>9}  "
        f"{'time s':>6}",
        flush=True,
    )
    scores, parts = [], []
    for n in stages:
        part = report.with_name(f"{report.stem}.stage{n:02d}.xml")
        scores.append(
            grade_stage(checkout, root, n, test_dirs[n], n - 1 if isolated else 0, part, expected[n], timeout_s)
        )
        parts.append(part)
        print_row(scores[-1])
    merge_reports(parts, report)
    got, total = sum(s.passed for s in scores), sum(s.total for s in scores)
    print(f"   {'all':>5}  {f'{got}/{total}':>12}    report: {report}")
    for score in scores:
        if score.first_error is not None:
            print(f"   stage {score.stage}, first error: {score.first_error}")
    return scores


def ungraded_reason(checkout: Path) -> str | None:
    if not checkout.exists():
        return f"{checkout} does not exist"
    if not checkout.is_dir():
        return f"{checkout} is not a folder"
    if not (checkout / "stages").is_dir():
        return f"no stages/ folder in {checkout}: nothing to grade"
    return None


def write_summaries(folder: Path, scoring: str, stages: list[int], results: list[dict[str, Any]]) -> None:
    """summary.json (everything) and summary.csv (a row per checkout and stage) in ``folder``."""
    (folder / "summary.json").write_text(
        json.dumps({"scoring": scoring, "stages": stages, "checkouts": results}, indent=2) + "\n"
    )
    fields = ["checkout", "name", "stage", *[f for f in StageScore.__dataclass_fields__ if f != "stage"]]
    with open(folder / "summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for result in results:
            rows = result["stages"] or [{"stage": "", "problem": result["problem"]}]
            for row in rows:
                writer.writerow({"checkout": result["checkout"], "name": result["name"], **row})


def print_class_table(stages: list[int], results: list[dict[str, Any]]) -> None:
    width = max(8, *(len(result["name"]) for result in results))
    print(f"\n{'checkout':<{width}}  " + "  ".join(f"{f'stage {n}':>9}" for n in stages) + f"  {'all':>9}")
    for result in results:
        if result["problem"] is not None and not result["stages"]:
            print(f"{result['name']:<{width}}  not graded: {result['problem']}")
            continue
        cells = [f"{s['passed']}/{s['total']}" for s in result["stages"]] + [f"{result['passed']}/{result['total']}"]
        print(f"{result['name']:<{width}}  " + "  ".join(f"{cell:>9}" for cell in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: " + __doc__.split("Exit status: ")[1].split("\n\n")[0],
    )
    parser.add_argument(
        "checkouts", nargs="*", type=Path, default=[REPO], help="learners' repository folders (default: this one)"
    )
    parser.add_argument(
        "--junit-dir",
        type=Path,
        default=REPO / "reports" / "grades",
        help="where the JUnit XML files and summary.csv / summary.json go",
    )
    parser.add_argument("--stages", type=parse_stages, help="which stages, e.g. 1-4 (default: all with tests)")
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="score stage N on the reference stages 1..N-1 (default: on the learner's own)",
    )
    parser.add_argument(
        "--stage-timeout",
        type=float,
        default=STAGE_TIMEOUT_S,
        metavar="SECONDS",
        help="stop a stage's run after this long; the tests it did not run count as errors "
        f"(default {STAGE_TIMEOUT_S})",
    )
    parser.add_argument("--root", type=Path, default=REPO, help=argparse.SUPPRESS)  # the machinery's own tests
    args = parser.parse_args(argv)
    root = args.root.resolve()

    test_dirs = graded_test_dirs(root)
    stages = sorted(n for n in test_dirs if args.stages is None or n in args.stages)
    if not stages:
        print("no graded tests (tests/stageNN/) for the chosen stages")
        return 1
    reference_env = child_env(ENGINE_IMPL="solutions", ENGINE_SOLUTIONS_DIR=str(root / "solutions"))
    expected = Counter(
        stage_of(test) for test in collect([str(test_dirs[n]) for n in stages], reference_env, root=root)
    )
    missing = [n for n in stages if not expected[n]]
    if missing:
        print(f"this repository's tests of stage(s) {missing} do not collect on the reference: fix that first")
        return 2
    args.junit_dir.mkdir(parents=True, exist_ok=True)
    scoring = "isolated" if args.isolated else "cumulative"
    print(
        "scoring: "
        + (
            "isolated (stage N on the reference stages 1..N-1)"
            if args.isolated
            else "cumulative (every stage on the learner's own earlier stages; --isolated: on the reference)"
        )
    )

    results: list[dict[str, Any]] = []
    taken: set[str] = set()
    for checkout in (c.expanduser().resolve() for c in args.checkouts):
        name = report_name(checkout, taken)
        report = args.junit_dir / f"{name}.xml"
        print(f"\n== {checkout}", flush=True)
        problem = ungraded_reason(checkout)
        scores: list[StageScore] = []
        if problem is not None:
            print(f"   not graded: {problem} (report: {report})")
            error_report(report, problem)
        else:
            scores = grade_checkout(
                checkout, root, test_dirs, stages, expected, report, args.isolated, args.stage_timeout
            )
            problem = "; ".join(s.problem for s in scores if s.problem is not None) or None
        results.append(
            {
                "checkout": str(checkout),
                "name": name,
                "report": str(report),
                "problem": problem,
                "passed": sum(s.passed for s in scores),
                "total": sum(s.total for s in scores) if scores else sum(expected[n] for n in stages),
                "stages": [asdict(score) for score in scores],
            }
        )

    print_class_table(stages, results)
    write_summaries(args.junit_dir, scoring, stages, results)
    print(f"\nsummary: {args.junit_dir / 'summary.csv'} and summary.json; one JUnit report per checkout beside them")
    return 1 if any(result["problem"] is not None for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
