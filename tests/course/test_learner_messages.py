"""What a learner sees when an exercise is not written yet (not graded).

Runs pytest on the real skeleton in stages/, as `make stage-4` does, and checks that the
failure names the file, line and function to write, that an earlier stage's exercise says how
to test this stage without it, and that the summary lists each exercise once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from impl_switch import SWITCH_VARS

REPO = Path(__file__).resolve().parents[2]


def learner_run(*tests: str, reference_upto: int = 0) -> str:
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS}
    env.update(ENGINE_IMPL="stages", ENGINE_REFERENCE_UPTO=str(reference_upto))
    done = subprocess.run([sys.executable, "-m", "pytest", *tests, "-q", "--tb=short", "-p", "no:cacheprovider"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, f"the skeleton's tests should fail (exit 1), got {done.returncode}:\n{done.stdout[-3000:]}"
    return done.stdout


def test_an_unwritten_exercise_names_its_file_line_and_function():
    out = learner_run("tests/stage04/test_allocator.py", reference_upto=3)
    assert "not written yet: stages/s04_paged_kv_pool/allocator.py:" in out, out[-3000:]
    assert "in TokenToKVPoolAllocator.alloc_extend\n-> Stage 4: " in out, out[-3000:]
    assert "REFERENCE_UPTO" not in out, "an exercise of the stage under test needs no hint about earlier stages"
    summary = out.split("exercises not written yet")[-1]
    assert "test(s) stop at stages/s04_paged_kv_pool/allocator.py:" in summary, out[-3000:]


def test_an_earlier_stages_exercise_says_how_to_test_without_it():
    out = learner_run("tests/stage04/test_static_batch.py::test_page_sizes_give_identical_tokens")
    assert "-> Stage 2: " in out, out[-3000:]
    assert "make stage-4 REFERENCE_UPTO=3" in out, out[-3000:]
