"""Grade learners' checkouts with this repository's graded tests.

For each checkout, the graded tests tests/stageNN/ of *this* repository run against the
checkout's stages/ (ENGINE_IMPL=stages, ENGINE_STAGES_DIR=<checkout>/stages; the provided
s00_foundation always comes from solutions/), one pytest run per stage, each under a time limit
(--stage-timeout). So a checkout whose code does not import, or that loops where no test's own
limit reaches (at import time, in a fixture), costs that stage only: never its other stages, and
never the rest of the class.

Each checkout gets a JUnit XML report and a table, a row printed as each stage ends: passed/total,
failed, errors, skipped, unwritten, seconds. "total" is the number of tests the reference
collects, so tests that never ran (their module does not import against the learner's code, the
stage's run was stopped) still count in full, as errors. "unwritten" counts the failures at an
exercise not written yet (the skeleton's NotImplementedError). Under the table: each stage's
first error, with where it was raised (for a run stopped at its limit, where it was; for one that
ended its own process, the test it was running), else its first failure and its message. The
report holds a test suite per stage (stageNN, the checkout's path as a property) with every
test the table counts: one that never ran is an error saying why. A report is named after the
checkout's folder, with as many parent folders as it takes to tell checkouts of the same name
apart (alice-engine-course, bob-engine-course).

At the end: the class's table (a row per checkout, passed/total per stage), also written as
summary.csv and summary.json beside the JUnit files.

A learner's code runs with your rights, in this repository: grading is not a sandbox. A stage's
run that changes this repository's own files (tests/, tools/, solutions/, its top-level files: a
conftest.py planted there would score every later checkout) stops the grading, saying what
changed; code that patches pytest in its own process is not caught (grade in a container when
that matters). Ctrl-C stops the grading and the stage's run with all it started (exit 130).

Two ways to score, both per stage:

    cumulative (default)  every stage runs on the learner's own earlier stages: stage N's score
                          says whether *their engine* does stage N (an unfinished stage 2 costs
                          points in every later stage)
    --isolated            stage N runs on the reference stages 1..N-1: the score is stage N's
                          own work, whatever came before

Exit status: 0 when every checkout was graded to the end; 1 when a checkout could not be graded
at all (no such folder, no stages/ in it), a stage's run was stopped at its time limit or ended
without a report (its tests count as errors in the table; the line under it says why), or one
changed this repository's files; 2 when this repository's own tests do not collect, or an
option is wrong; 130 on Ctrl-C.

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
INTERRUPTED_AT = re.compile(r"^(\S+\.py):(\d+): KeyboardInterrupt$", re.MULTILINE)  # where a stopped run was
# pytest -v names each test as it starts ("tests/stage02/test_x.py::test_a[p] "), then its outcome
TEST_STARTED = re.compile(r"^(tests/\S+\.py::.*?)(?: (?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b.*)?$")


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
    first_failure: str | None = None  # its first failed test and the failure's message


def report_names(checkouts: list[Path]) -> list[str]:
    """A file name per checkout: its folder's name, with as many of its parent folders as it takes
    to tell it from the others (everyone clones into "engine-course": alice-engine-course)."""
    parts = [[part for part in checkout.parts if part != checkout.anchor] or ["checkout"] for checkout in checkouts]
    depth = [1] * len(checkouts)
    while True:
        names = ["-".join(p[-d:]) for p, d in zip(parts, depth)]
        same = [i for i, name in enumerate(names) if names.count(name) > 1 and depth[i] < len(parts[i])]
        if not same:
            break
        for i in same:
            depth[i] += 1
    taken: set[str] = set()
    for i, base in enumerate(names):  # ("a-b/c" and "a/b-c" still meet: a number tells them apart)
        name, k = base, 2
        while name in taken:
            name, k = f"{base}-{k}", k + 1
        names[i] = name
        taken.add(name)
    return names


def error_report(path: Path, message: str, details: str = "", name: str = "grade") -> None:
    """A JUnit file that says, machine-readably, why nothing (of a stage) was graded."""
    suite = ET.Element("testsuite", name=name, tests="1", errors="1", failures="0", skipped="0")
    case = ET.SubElement(suite, "testcase", classname=name, name="run")
    ET.SubElement(case, "error", message=message).text = details
    root = ET.Element("testsuites", name="grade")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def junit_id(test: str) -> str:
    """A pytest node id as the JUnit report names its test (read_junit's "classname::name"):
    'tests/stage02/test_x.py::TestA::test_b[p]' -> 'tests.stage02.test_x.TestA::test_b[p]'."""
    head, bracket, params = test.partition("[")
    path, *names = head.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *names[:-1]]) + "::" + names[-1] + bracket + params


def complete_report(part: Path, n: int, checkout: Path, expected: list[str], why: str, details: str) -> int:
    """Make stage N's report (a JUnit file pytest wrote, or none) one test suite named stageNN,
    with the checkout's path as a property, that holds every test the reference has: each one
    that did not run is added as an error saying ``why`` (the first with ``details``). So the
    report counts what the table counts. Returns how many were added."""
    root = ET.parse(part).getroot() if part.is_file() else ET.Element("testsuites")
    suites = list(root.iter("testsuite"))
    suite = suites[0] if suites else ET.SubElement(root, "testsuite", tests="0", errors="0", failures="0", skipped="0")
    suite.set("name", f"stage{n:02d}")
    properties = suite.find("properties")
    if properties is None:
        properties = ET.Element("properties")
        suite.insert(0, properties)
    ET.SubElement(properties, "property", name="checkout", value=str(checkout))
    ran = {f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")}
    missing = [test for test in expected if test not in ran]
    for i, test in enumerate(missing):
        classname, _, name = test.partition("::")
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")
        ET.SubElement(case, "error", message=f"not run: {why}").text = details if i == 0 else None
    for field, added in (("tests", len(missing)), ("errors", len(missing))):
        suite.set(field, str(int(suite.get(field, "0")) + added))
    ET.ElementTree(root).write(part, encoding="utf-8", xml_declaration=True)
    return len(missing)


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
    relative paths are from ``root``, where pytest ran) in the checkout (a learner's file), else
    the innermost outside the grader's own tools/; '' if the text names none."""
    places = []
    for line in text.splitlines():
        line = line.removeprefix("E ").strip()
        found = PYTHON_PLACE.search(line) or PYTEST_PLACE.match(line)
        if found:
            places.append(((root / found.group(1)).resolve(), found.group(2)))  # an absolute place stays
    learners = [place for place in places if place[0].is_relative_to(checkout)]
    shown = learners or [place for place in places if not place[0].is_relative_to(root / "tools")]
    return f" (at {place_text(*shown[-1], checkout)})" if shown else ""


def place_text(path: Path, line: str, checkout: Path) -> str:
    """'stages/s02_.../sampler.py:12': relative to the checkout when it is in it."""
    return f"{(path.relative_to(checkout) if path.is_relative_to(checkout) else path).as_posix()}:{line}"


def first_error(report: Path, checkout: Path, root: Path) -> str | None:
    """The first error (not failure) in a JUnit report, in one line: why a test could not run,
    the exception (the last line of its traceback, e.g. a SyntaxError) and where it was raised."""
    for error in ET.parse(report).iter("error"):
        text = error.text or ""
        lines = [line.removeprefix("E ").strip() for line in text.splitlines() if line.strip()]
        what = lines[-1] if lines else error.get("message") or "(no message)"
        return (what[:300] + where_raised(text, checkout, root))[:400]
    return None


def first_failure(report: Path) -> str | None:
    """The first failed test in a JUnit report and the first line of its message, in one line:
    what the instructor reads when a stage's tests all ran and some failed."""
    for case in ET.parse(report).iter("testcase"):
        failure = case.find("failure")
        if failure is not None:
            message = (failure.get("message") or failure.text or "(no message)").strip().split("\n")[0]
            module = (case.get("classname") or "").rsplit(".", 1)[-1]
            return f"{module}::{case.get('name')}: {message}"[:400]
    return None


def stopped_where(output: str, checkout: Path, root: Path) -> str | None:
    """Where a run stopped at its time limit was (pytest prints 'path:line: KeyboardInterrupt')."""
    found = INTERRUPTED_AT.findall(output)
    return place_text((root / found[-1][0]).resolve(), found[-1][1], checkout) if found else None


def last_test_started(output: str) -> str | None:
    """The test pytest -v had started last, from its output."""
    started = [found.group(1).strip() for line in output.splitlines() if (found := TEST_STARTED.match(line))]
    return started[-1] if started else None


def unwritten_failures(report: Path) -> int:
    """Tests that stopped at an exercise not written yet."""
    return sum(
        UNWRITTEN.match(case.get("message") or "") is not None
        for case in ET.parse(report).iter()
        if case.tag in ("failure", "error")
    )


def grade_stage(
    checkout: Path,
    root: Path,
    n: int,
    tests: Path,
    reference_upto: int,
    part: Path,
    expected: list[str],
    timeout_s: float,
) -> StageScore:
    """Stage N's graded tests on ``checkout`` (stages below ``reference_upto`` from the reference),
    its JUnit report in ``part``, holding every test of ``expected`` (the reference's, as
    junit_id names them)."""
    env = child_env(
        ENGINE_IMPL="stages",
        ENGINE_REFERENCE_UPTO=str(reference_upto),
        ENGINE_STAGES_DIR=str(checkout / "stages"),
        ENGINE_SOLUTIONS_DIR=str(root / "solutions"),
    )
    part.unlink(missing_ok=True)  # an earlier grading's, which a run that writes none would leave to be read
    start = time.perf_counter()
    verbose = ("--verbosity=1",)  # pytest names each test as it starts: what a run that ended itself was running
    run = run_pytest([str(tests)], env, junit=part, root=root, timeout_s=timeout_s, extra=verbose)
    score = StageScore(n, len(expected), seconds=time.perf_counter() - start)
    if run.timed_out:
        at = stopped_where(run.output, checkout, root)
        score.problem = (
            f"stage {n}'s run was stopped after {timeout_s:g} s (--stage-timeout)"
            + (f" at {at}" if at else ": a loop that never ends where no test's own limit reaches (at import time?)")
            + "; its tests that had not run count as errors"
        )
        why = f"stage {n}'s run was stopped at its time limit (--stage-timeout {timeout_s:g})"
    elif not part.is_file():
        test = last_test_started(run.output)
        score.problem = f"stage {n}'s pytest exited {run.returncode} without a report" + (
            f", while {test} ran (does the code end the process: os._exit, a crash?)"
            if test
            else where_raised(run.output, checkout, root)
        )
        why = score.problem
    else:
        why = "its module did not import, or its tests did not collect, against this checkout"
    tests_run = {test: outcome for test, outcome in run.outcomes.items() if "::" in test}  # not module entries
    not_run = complete_report(part, n, checkout, expected, why, run.output[-5000:])
    kinds = Counter(tests_run.values())
    score.total = max(len(expected), len(tests_run))
    score.passed, score.failed, score.skipped = kinds["passed"], kinds["failed"], kinds["skipped"]
    score.errors = kinds["error"] + not_run
    score.unwritten = unwritten_failures(part)
    score.first_error = score.problem or first_error(part, checkout, root)  # a stopped run: its tests not run
    score.first_failure = first_failure(part)
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
    expected: dict[int, list[str]],
    report: Path,
    isolated: bool,
    timeout_s: float,
    guarded: dict[Path, tuple[int, int]],
) -> tuple[list[StageScore], str | None]:
    """Every chosen stage on ``checkout``, printing its row as it ends; the stages' reports merged
    into ``report``. Stops after a stage whose run changed this repository's own files (``guarded``,
    as grader_files read them before): then also says what changed."""
    print(
        f"   {'stage':>5}  {'passed/total':>12}  {'failed':>6}  {'errors':>6}  {'skipped':>7}  {'unwritten':>9}  "
        f"{'time s':>6}",
        flush=True,
    )
    scores, parts, changed = [], [], None
    for n in stages:
        part = report.with_name(f"{report.stem}.stage{n:02d}.xml")
        scores.append(
            grade_stage(checkout, root, n, test_dirs[n], n - 1 if isolated else 0, part, expected[n], timeout_s)
        )
        parts.append(part)
        print_row(scores[-1])
        changed = changed_files(guarded, grader_files(root), root)
        if changed is not None:
            scores[-1].problem = (
                f"stage {n}'s run changed this repository's own files ({changed}): the checkout's code wrote "
                "there, so this score and any later one could be its doing, and grading stops; restore them "
                "(git status, git checkout, git clean) and grade again"
            )
            print(f"   {scores[-1].problem}")
            break
    merge_reports(parts, report)
    got, total = sum(s.passed for s in scores), sum(s.total for s in scores)
    print(f"   {'all':>5}  {f'{got}/{total}':>12}    report: {report}")
    for score in scores:
        if score.first_error is not None:
            print(f"   stage {score.stage}, first error: {score.first_error}")
        elif score.first_failure is not None:
            print(f"   stage {score.stage}, first failure: {score.first_failure}")
    return scores, changed


def grader_files(root: Path) -> dict[Path, tuple[int, int]]:
    """The files of this repository that decide a grade, which no learner's run may change: its
    top-level files (a conftest.py there would be loaded), tests/, tools/ and solutions/ (bytecode
    caches aside), each with its size and modification time."""
    files = [
        *root.glob("*"),
        *(file for folder in ("tests", "tools", "solutions") for file in (root / folder).rglob("*")),
    ]
    return {
        file: (info.st_size, info.st_mtime_ns)
        for file in files
        if "__pycache__" not in file.parts and file.is_file()
        for info in [file.stat()]
    }


def changed_files(before: dict[Path, tuple[int, int]], after: dict[Path, tuple[int, int]], root: Path) -> str | None:
    """What differs between two grader_files readings ('added tests/stage01/conftest.py'), or None."""
    kinds = {
        "added": sorted(after.keys() - before.keys()),
        "removed": sorted(before.keys() - after.keys()),
        "changed": sorted(file for file in before.keys() & after.keys() if before[file] != after[file]),
    }
    said = [
        f"{kind} "
        + ", ".join(file.relative_to(root).as_posix() for file in files[:3])
        + (" ..." if len(files) > 3 else "")
        for kind, files in kinds.items()
        if files
    ]
    return "; ".join(said) or None


def ungraded_reason(checkout: Path) -> str | None:
    if not checkout.exists():
        return f"{checkout} does not exist"
    if not checkout.is_dir():
        return f"{checkout} is not a folder"
    if not (checkout / "stages").is_dir():
        return f"no stages/ folder in {checkout}: nothing to grade"
    return None


def write_summaries(folder: Path, scoring: str, totals: dict[int, int], results: list[dict[str, Any]]) -> None:
    """summary.json (everything) and summary.csv (a row per checkout and stage) in ``folder``;
    ``totals``: each stage's number of tests."""
    (folder / "summary.json").write_text(
        json.dumps({"scoring": scoring, "stages": list(totals), "checkouts": results}, indent=2) + "\n"
    )
    fields = ["checkout", "name", "stage", *[f for f in StageScore.__dataclass_fields__ if f != "stage"]]
    with open(folder / "summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for result in results:
            # a checkout not graded: a row per stage too, with nothing passed, so the sheet's sums hold it
            rows = result["stages"] or [
                {"stage": n, "total": total, "passed": 0, "problem": result["problem"]} for n, total in totals.items()
            ]
            for row in rows:
                writer.writerow({"checkout": result["checkout"], "name": result["name"], **row})


def print_class_table(stages: list[int], results: list[dict[str, Any]]) -> None:
    width = max(8, *(len(result["name"]) for result in results))
    print(f"\n{'checkout':<{width}}  " + "  ".join(f"{f'stage {n}':>9}" for n in stages) + f"  {'all':>9}")
    for result in results:
        if result["problem"] is not None and not result["stages"]:
            print(f"{result['name']:<{width}}  not graded: {result['problem']}")
            continue
        graded = {s["stage"]: f"{s['passed']}/{s['total']}" for s in result["stages"]}  # (all, unless grading stopped)
        cells = [graded.get(n, "-") for n in stages] + [f"{result['passed']}/{result['total']}"]
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
        type=positive_seconds,
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
    expected: dict[int, list[str]] = {n: [] for n in stages}
    for test in collect([str(test_dirs[n]) for n in stages], reference_env, root=root):
        if (n := stage_of(test)) in expected:
            expected[n].append(junit_id(test))
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
    checkouts = [c.expanduser().resolve() for c in args.checkouts]
    for twice in sorted({c for c in checkouts if checkouts.count(c) > 1}):
        print(f"{twice} is named {checkouts.count(twice)} times: it is graded once")
    checkouts = list(dict.fromkeys(checkouts))
    try:
        results = grade_class(
            checkouts, root, test_dirs, stages, expected, args.junit_dir, args.isolated, args.stage_timeout
        )
    except KeyboardInterrupt:  # the stage's run is stopped already, with all it started (run_pytest)
        print(f"\ninterrupted: grading stopped, no summary written (the finished checkouts' reports: {args.junit_dir})")
        return 130
    print_class_table(stages, results)
    write_summaries(args.junit_dir, scoring, {n: len(expected[n]) for n in stages}, results)
    print(f"\nsummary: {args.junit_dir / 'summary.csv'} and summary.json; one JUnit report per checkout beside them")
    return 1 if any(result["problem"] is not None for result in results) else 0


def grade_class(
    checkouts: list[Path],
    root: Path,
    test_dirs: dict[int, Path],
    stages: list[int],
    expected: dict[int, list[str]],
    junit_dir: Path,
    isolated: bool,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Each checkout in turn, its table printed as it goes: its results (a dict each, as
    summary.json holds them). After a checkout that changed this repository's own files, the
    rest are not graded."""
    results: list[dict[str, Any]] = []
    guarded, stopped = grader_files(root), None
    for checkout, name in zip(checkouts, report_names(checkouts)):
        report = junit_dir / f"{name}.xml"
        print(f"\n== {checkout}", flush=True)
        problem = ungraded_reason(checkout) if stopped is None else stopped
        scores: list[StageScore] = []
        if problem is not None:
            print(f"   not graded: {problem} (report: {report})")
            error_report(report, problem)
        else:
            scores, changed = grade_checkout(
                checkout, root, test_dirs, stages, expected, report, isolated, timeout_s, guarded
            )
            problem = "; ".join(s.problem for s in scores if s.problem is not None) or None
            if changed is not None:
                stopped = f"grading stopped: {checkout}'s code changed this repository's own files ({changed})"
        results.append(
            {
                "checkout": str(checkout),
                "name": name,
                "report": str(report),
                "problem": problem,
                "passed": sum(s.passed for s in scores),
                "total": sum(s.total for s in scores) if scores else sum(len(expected[n]) for n in stages),
                "stages": [asdict(score) for score in scores],
            }
        )
    return results


def positive_seconds(text: str) -> float:
    """--stage-timeout's value: seconds, more than 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:  # (also NaN)
        raise argparse.ArgumentTypeError(f"{text!r}: give the seconds a stage's run may take, a number above 0")
    return seconds


if __name__ == "__main__":
    sys.exit(main())
