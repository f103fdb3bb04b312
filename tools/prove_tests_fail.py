"""Prove that every graded test can fail.

For each stage N with graded tests (tests/stageNN/) this runs them against the skeleton of
stage N with the reference for stages < N (ENGINE_IMPL=stages ENGINE_REFERENCE_UPTO=N-1)
and requires every collected test to fail (an error counts as a failure). A test that
passes or skips there would pass for a learner who wrote nothing: it is reported as a
defect. With --solutions the same tests must also all pass on the reference.

The skeleton is generated afresh from solutions/ into a temporary folder, so the proof
holds for what solutions/ generates, whatever state stages/ is in.

    python tools/prove_tests_fail.py [--stages 1-4] [--solutions] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pytest_runs import REPO, child_env, graded_test_dirs, parse_stages, run_pytest


def stage_numbers(root: Path) -> dict[int, tuple[Path | None, Path | None]]:
    """Stage N -> (tests/stageNN or None, solutions/sNN_* or None), for N >= 1."""
    found: dict[int, list] = {}
    for n, folder in graded_test_dirs(root).items():
        found.setdefault(n, [None, None])[0] = folder
    for package in sorted((root / "solutions").glob("s[0-9][0-9]_*")):
        if package.is_dir() and int(package.name[1:3]) >= 1:
            found.setdefault(int(package.name[1:3]), [None, None])[1] = package
    return {n: tuple(pair) for n, pair in sorted(found.items())}


def prove_stage(
    n: int, tests: Path, root: Path, skeleton: str, with_solutions: bool, threads: str | None
) -> tuple[tuple, list[str]]:
    """Stage N's tests on its skeleton (and on the solutions): its table row and its defects.
    ``threads``: torch's thread count in the child (OMP_NUM_THREADS), None to leave it be."""
    print(f"stage {n}: running tests/stage{n:02d} on the skeleton ...", flush=True)
    env = child_env(
        ENGINE_IMPL="stages",
        ENGINE_REFERENCE_UPTO=str(n - 1),
        ENGINE_STAGES_DIR=skeleton,
        ENGINE_SOLUTIONS_DIR=str(root / "solutions"),
        OMP_NUM_THREADS=threads,
    )
    run = run_pytest([str(tests)], env, root=root)
    counts = {k: sum(v == k for v in run.outcomes.values()) for k in ("failed", "error", "passed", "skipped")}
    bad = []
    if not run.outcomes:
        bad.append(
            f"stage {n}: no test ran on the skeleton (pytest exit {run.returncode}):\n"
            + "\n".join(run.output.splitlines()[-15:])
        )
    for test, outcome in sorted(run.outcomes.items()):
        if outcome in ("passed", "skipped"):
            bad.append(f"stage {n}: {test} {outcome.upper()} on the skeleton; it must fail there")
        elif test.endswith("(collecting the module)"):
            bad.append(
                f"stage {n}: {test} errors on the skeleton: its tests cannot be collected, "
                "so none of them is shown to fail on its own"
            )
    if with_solutions:
        print(f"stage {n}: running tests/stage{n:02d} on the solutions ...", flush=True)
        reference = run_pytest(
            [str(tests)],
            child_env(ENGINE_IMPL="solutions", ENGINE_SOLUTIONS_DIR=str(root / "solutions"), OMP_NUM_THREADS=threads),
            root=root,
        )
        for test, outcome in sorted(reference.outcomes.items()):
            if outcome != "passed":
                bad.append(f"stage {n}: {test} {outcome.upper()} on the solutions; it must pass there")
        if not reference.outcomes:
            bad.append(f"stage {n}: no test ran on the solutions (pytest exit {reference.returncode})")
    verdict = "DEFECT" if bad else "ok: every test fails on the skeleton"
    return (n, len(run.outcomes), counts["failed"] + counts["error"], counts["passed"], counts["skipped"], verdict), bad


def prove(root: Path, wanted: set[int] | None, with_solutions: bool, jobs: int) -> int:
    rows: list[tuple] = []  # one table row per stage
    defects: list[str] = []
    with tempfile.TemporaryDirectory(prefix="skeleton-") as skeleton:
        made = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("make_skeleton.py")),
                "--solutions",
                str(root / "solutions"),
                "--stages",
                skeleton,
            ],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            print(f"cannot generate the skeleton:\n{made.stderr}", file=sys.stderr)
            return 2
        runs = []
        # Each stage is its own pytest process, mostly waiting on imports and on tests that fail
        # at once: two at a time keep two cores busy (the table keeps the stages' order). Each then
        # runs torch on one thread, unless OMP_NUM_THREADS says otherwise: more would oversubscribe.
        threads = os.environ.get("OMP_NUM_THREADS") or ("1" if jobs > 1 else None)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for n, (tests, package) in stage_numbers(root).items():
                if wanted is not None and n not in wanted:
                    continue
                if tests is None:
                    rows.append((n, "", "", "", "", f"skipped: no tests in tests/stage{n:02d}/ yet"))
                elif package is None:
                    rows.append((n, "", "", "", "", "DEFECT"))
                    defects.append(f"stage {n}: tests/stage{n:02d} exists but solutions/ has no s{n:02d}_* package")
                else:
                    runs.append(pool.submit(prove_stage, n, tests, root, skeleton, with_solutions, threads))
            for run in runs:
                row, bad = run.result()
                rows.append(row)
                defects += bad
    rows.sort(key=lambda row: row[0])

    print()
    print(f"{'stage':>5}  {'tests':>5}  {'failed':>6}  {'passed':>6}  {'skipped':>7}  verdict")
    for row in rows:
        print(f"{row[0]:>5}  {row[1]:>5}  {row[2]:>6}  {row[3]:>6}  {row[4]:>7}  {row[5]}")
    if not rows:
        print("(no stages found)")
    if defects:
        print(f"\n{len(defects)} defect(s):")
        for line in defects:
            print(f"  - {line}")
        return 1
    print(
        "\nno defects: every graded test fails on its stage's skeleton"
        + (" and passes on the solutions" if with_solutions else "")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=parse_stages, help="which stages, e.g. 1-4 or 2,5 (default: all)")
    parser.add_argument("--solutions", action="store_true", help="also require every test to pass on the solutions")
    parser.add_argument(
        "--jobs", type=int, default=2, help="stages run at once, each in its own pytest process (default: 2)"
    )
    parser.add_argument("--root", type=Path, default=REPO, help=argparse.SUPPRESS)  # the machinery's own tests
    args = parser.parse_args(argv)
    return prove(args.root.resolve(), args.stages, args.solutions, max(1, args.jobs))


if __name__ == "__main__":
    sys.exit(main())
