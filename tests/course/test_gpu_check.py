"""tools/gpu_check.py, rehearsed on a CPU (not graded: the course's own GPU check). `make
gpu-check REHEARSAL=1` runs every step of the GPU check with the capture replaced by the eager
path; here a short version of it runs end to end, so the first GPU run is not its first run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402
import offline_bundle  # noqa: E402


def rehearse(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_check.py"), "--rehearsal", "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_rehearsal_runs_every_step_and_leaves_what_a_gpu_run_brings_back(tmp_path):
    done = rehearse(tmp_path)
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, f"the rehearsal failed:\n{summary}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = summary.splitlines()
    assert lines[1].startswith("GPU: ") and "torch" in lines[2] and "CUDA" in lines[2] and "cuDNN" in lines[2], lines[
        :4
    ]
    for step in gpu_check.STEPS:
        assert f"PASS    {step.name} " in summary, f"step {step.name} did not pass:\n{summary}"
    results = json.loads((tmp_path / "results.json").read_text())
    assert [s["step"] for s in results["steps"]] == [s.name for s in gpu_check.STEPS]
    assert all(s["checks"] for s in results["steps"]), "every step reports its checks"
    # what the offline bundle needs to leave out what the machine has (pack --target-env)
    target = offline_bundle.read_target_env(tmp_path / "results.json")
    assert target["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0], target["packages"].get("torch")
    assert "<testsuite" in (tmp_path / "junit.xml").read_text()
    files = list(tmp_path.iterdir())
    assert len(files) <= 8 and all(f.is_file() and f.stat().st_size <= 16 << 20 for f in files), (
        f"a GPU machine brings back at most 8 files of 16 MiB, no folders: {[f.name for f in files]}"
    )


def test_a_step_past_its_timeout_is_killed_and_reported(tmp_path):
    done = rehearse(tmp_path, "--steps", "graphs-float32", "--step-timeout", "graphs-float32=0.3")
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 1, summary
    assert "TIMEOUT graphs-float32" in summary and "overall: FAIL (0 of 1 steps passed)" in summary, summary
    assert 'name="(step)"><failure' in (tmp_path / "junit.xml").read_text()


def test_the_second_runs_rehearsal_imports_every_gpu_test_and_leaves_what_it_brings_back(tmp_path):
    """`--full --rehearsal`: the parts run on a CPU; the GPU tests are collected (an import the GPU
    image would lack fails here) and skip, and the summary says nothing here is a GPU's."""
    done = rehearse(tmp_path, "--full", "--steps", "default-model,gpu-tests")
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, f"the second run's rehearsal failed:\n{summary}\n{done.stdout[-3000:]}"
    assert "PASS    default-model " in summary and "PASS    gpu-tests " in summary, summary
    assert "0 failed, 0 errors" in summary and "a rehearsal: no GPU, every file imported" in summary, summary
    assert "commit nothing from it" in summary, summary
    report = (tmp_path / "gpu_tests.xml").read_text()
    assert report.count("<testcase") >= 40 and "<skipped" in report, "the GPU tests were not collected"


def test_a_notebook_saved_elsewhere_is_left_as_it_was(tmp_path):
    """What the second run's rehearsal relies on for notebook 08 (its CPU figures must never replace
    the committed GPU ones): execute_notebooks.py --save-to writes the executed copy only there."""
    import nbformat

    source = tmp_path / "nb.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nbformat.write(notebook, source)
    before = source.read_text()
    (tmp_path / "out").mkdir()
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "execute_notebooks.py"), str(source), "--save-to", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert source.read_text() == before, "the notebook itself was rewritten"
    outputs = nbformat.read(tmp_path / "out" / "nb.ipynb", as_version=4).cells[0].outputs
    assert outputs and outputs[0]["text"] == "42\n", outputs
