"""The learners' make targets refuse a REFERENCE_UPTO that would put the reference in the place of
their own stage (not graded)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize("target,upto", [("stage-3", "3"), ("stage-3", "5"), ("upto-4", "4"), ("run-2", "2")])
def test_reference_upto_at_or_past_the_stage_is_refused(target, upto):
    # DEPS= skips the dependency install; setup still checks the default model, which make test has in place
    done = subprocess.run(
        ["make", "--no-print-directory", target, f"REFERENCE_UPTO={upto}", "DEPS="],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    n = int(target.split("-")[1])
    assert done.returncode == 2, (
        f"make {target} REFERENCE_UPTO={upto} should refuse (exit 2), exited "
        f"{done.returncode}:\n{done.stdout}{done.stderr}"
    )
    assert f"REFERENCE_UPTO={upto} takes stages 1..{upto} from solutions/, stage {n} included" in done.stdout, (
        done.stdout
    )
    assert f"Use REFERENCE_UPTO={n - 1} or less" in done.stdout, done.stdout
