"""Grade learners' checkouts with this repository's graded tests.

For each checkout, the graded tests tests/stageNN/ of *this* repository run against the
checkout's stages/ (ENGINE_IMPL=stages, ENGINE_STAGES_DIR=<checkout>/stages; the provided
s00_foundation always comes from solutions/). Each checkout gets a JUnit XML report and a
per-stage table; "total" is the number of tests the reference collects, so a stage whose
test modules cannot even be imported against the learner's code still counts in full.
"errors" counts tests that could not run at all (the checkout's code does not import, or a
fixture broke); the first such error is printed under the table.

Two ways to score, both per stage:

    cumulative (default)  every stage runs on the learner's own earlier stages: stage N's score
                          says whether *their engine* does stage N (an unfinished stage 2 costs
                          points in every later stage)
    --isolated            stage N runs on the reference stages 1..N-1 (one pytest run per
                          stage): the score is stage N's own work, whatever came before

    python tools/grade.py [CHECKOUT ...] [--junit-dir DIR] [--stages 1-4] [--isolated]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from pytest_runs import REPO, child_env, collect, graded_test_dirs, parse_stages, run_pytest, stage_of


def report_name(checkout: Path, taken: set[str]) -> str:
    """A file name for the checkout's report, unique among `taken`."""
    base = checkout.name or "checkout"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    taken.add(name)
    return name


def error_report(path: Path, message: str, details: str = "") -> None:
    """A JUnit file that says, machine-readably, why nothing was graded."""
    suite = ET.Element("testsuite", name="grade", tests="1", errors="1", failures="0", skipped="0")
    case = ET.SubElement(suite, "testcase", classname="grade", name="checkout")
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


def first_error(report: Path) -> str | None:
    """The first error (not failure) in a JUnit report, in one line: why a test could not run.
    The last line of its traceback names the exception (e.g. a SyntaxError in the checkout)."""
    for error in ET.parse(report).iter("error"):
        lines = [line.removeprefix("E ").strip() for line in (error.text or "").splitlines() if line.strip()]
        return (lines[-1] if lines else error.get("message") or "(no message)")[:300]
    return None


def grade_checkout(
    checkout: Path, root: Path, test_dirs: dict[int, Path], stages: list[int], report: Path, isolated: bool
) -> dict[str, str]:
    """Run the chosen stages' tests on ``checkout``; write ``report``; return each test's outcome."""

    def env(reference_upto: int):
        return child_env(
            ENGINE_IMPL="stages",
            ENGINE_REFERENCE_UPTO=str(reference_upto),
            ENGINE_STAGES_DIR=str(checkout / "stages"),
            ENGINE_SOLUTIONS_DIR=str(root / "solutions"),
        )

    runs = (
        [([str(test_dirs[n]) for n in stages], 0, report)]
        if not isolated
        else [([str(test_dirs[n])], n - 1, report.with_name(f"{report.stem}.stage{n:02d}.xml")) for n in stages]
    )
    outcomes: dict[str, str] = {}
    for paths, reference_upto, junit in runs:
        run = run_pytest(paths, env(reference_upto), junit=junit, root=root)
        if not junit.is_file():
            print(f"   pytest wrote no report for {', '.join(paths)} (exit {run.returncode}); its output ends:")
            print("\n".join("   | " + line for line in run.output.splitlines()[-15:]))
            error_report(junit, f"pytest exited {run.returncode} without a report", run.output[-5000:])
        outcomes.update(run.outcomes)
    if isolated:
        merge_reports([junit for _, _, junit in runs], report)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkouts", nargs="*", type=Path, default=[REPO], help="learners' repository folders (default: this one)"
    )
    parser.add_argument(
        "--junit-dir", type=Path, default=REPO / "reports" / "grades", help="where the JUnit XML files go"
    )
    parser.add_argument("--stages", type=parse_stages, help="which stages, e.g. 1-4 (default: all with tests)")
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="score stage N on the reference stages 1..N-1 (default: on the learner's own)",
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
    args.junit_dir.mkdir(parents=True, exist_ok=True)
    print(
        "scoring: "
        + (
            "isolated (stage N on the reference stages 1..N-1)"
            if args.isolated
            else "cumulative (every stage on the learner's own earlier stages; --isolated: on the reference)"
        )
    )

    summary: list[tuple] = []  # (checkout, points, total), None when it could not be graded
    taken: set[str] = set()
    for checkout in (c.resolve() for c in args.checkouts):
        report = args.junit_dir / f"{report_name(checkout, taken)}.xml"
        print(f"\n== {checkout}")
        if not (checkout / "stages").is_dir():
            print(f"   no stages/ folder here: nothing to grade (report: {report})")
            error_report(report, f"no stages/ folder in {checkout}")
            summary.append((checkout, None, None))
            continue
        outcomes = grade_checkout(checkout, root, test_dirs, stages, report, args.isolated)
        passed, skipped, errored = (
            Counter(stage_of(t) for t, outcome in outcomes.items() if outcome == kind)
            for kind in ("passed", "skipped", "error")
        )
        ran = Counter(stage_of(t) for t in outcomes)
        print(f"   {'stage':>5}  {'passed/total':>12}  {'skipped':>7}  {'errors':>6}")
        for n in stages:
            total = max(expected[n], ran[n])
            print(f"   {n:>5}  {f'{passed[n]}/{total}':>12}  {skipped[n]:>7}  {errored[n]:>6}")
        got, total = sum(passed[n] for n in stages), sum(max(expected[n], ran[n]) for n in stages)
        errors = sum(errored.values())
        print(f"   {'all':>5}  {f'{got}/{total}':>12}  {sum(skipped.values()):>7}  {errors:>6}    report: {report}")
        if errors:
            print(f"   first error: {first_error(report)}")
        summary.append((checkout, got, total))

    if len(summary) > 1:
        print(f"\n{'checkout':<40}  passed/total")
        for checkout, got, total in summary:
            print(f"{str(checkout)[-40:]:<40}  {'no stages/' if got is None else f'{got}/{total}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
