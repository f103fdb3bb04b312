"""stages/ is exactly what tools/make_skeleton.py generates from solutions/ (not graded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_stages_is_in_sync_with_solutions():
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_skeleton.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"stages/ is out of sync with solutions/:\n{done.stdout}{done.stderr}"
