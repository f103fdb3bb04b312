"""The parts of the second GPU run, `make gpu-check-full` (tools/gpu_check.py --full).

It needs the default model, so it runs after tools/offline_bundle.py has installed the bundle
into the GPU machine's Python (README: "On a GPU"). Each part runs as ``python tools/gpu_check_full.py
PART OUT RESULT`` under its own timeout and writes what it made into OUT:

    default-model      tools/setup_model.py: the GGUF of the bundle -> models/SmolLM2-135M-Instruct
    notebook-08        notebook 08 executed in place (its figures are this GPU's) -> 08_cuda_graph.ipynb
    benchmark-offline  stage 8 vs transformers on workload (a), --quick, and what logprobs and penalties cost
                       -> benchmark_offline.json
    gpu-tests          pytest tests/gpu (a missing GPU fails) -> gpu_tests.xml, output in log.txt

With everything gpu_check.py writes, OUT holds 7 files: what a GPU machine's output folder
brings back (at most 8, no subfolders).

A rehearsal on a CPU (`--full --rehearsal`, make gpu-check-full REHEARSAL=1) runs the same parts,
except that the GPU tests are collected and skip (so an import the image would lack still shows),
and notebook 08's executed copy goes only into OUT: its CPU figures never replace the committed ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from offline_bundle import DEFAULT_STASH, TARGET_SITE  # noqa: E402

NOTEBOOK = REPO / "notebooks" / "08_cuda_graph.ipynb"
HOW_TO_READ = """how to read this:
  - the first lines say what ran (GPU, driver, Python, torch, CUDA, cuDNN); one line per part follows;
  - gpu_tests.xml is pytest's JUnit report of tests/gpu and log.txt its full output (-rA lists every test);
  - 08_cuda_graph.ipynb is notebook 08 with this GPU's figures: commit it as notebooks/08_cuda_graph.ipynb;
  - benchmark_offline.json: stage 8 vs transformers on the GPU, for the issue notes (with the GPU's name)."""


def command(part: str, out: Path, result: Path, rehearsal: bool = False) -> tuple[list[str], dict]:
    """How gpu_check.py starts a part: this file in a child process, with the bundles' fallback
    folders (packages installed with pip --target) on PYTHONPATH."""
    sites = sorted(str(site) for site in DEFAULT_STASH.glob(f"*/{TARGET_SITE}") if site.is_dir())
    paths = sites + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {"ENGINE_IMPL": "solutions", "PYTHONPATH": os.pathsep.join(paths)} if paths else {"ENGINE_IMPL": "solutions"}
    argv = [sys.executable, str(Path(__file__).resolve()), part, str(out), str(result)]
    return argv + ["--rehearsal"] * rehearsal, env


def record(result: Path, check: str, ok: bool, detail: str, **data) -> int:
    result.write_text(
        json.dumps([{"check": check, "status": "PASS" if ok else "FAIL", "detail": detail, "data": data}])
    )
    print(f"{'PASS' if ok else 'FAIL'} {check}: {detail}", flush=True)
    return 0 if ok else 1


def run(cmd: list[str], **env) -> int:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}).returncode


def default_model(out: Path, result: Path, rehearsal: bool) -> int:
    code = run([sys.executable, "tools/setup_model.py"])
    return record(result, "the default model converted", code == 0, f"tools/setup_model.py exit {code}")


def gpu_tests(out: Path, result: Path, rehearsal: bool) -> int:
    report = out / "gpu_tests.xml"
    # A test file that cannot be imported there (a package the image lacks) is one error in the
    # report; by default pytest would stop the whole suite at collection.
    options = ["-rA", "-p", "no:cacheprovider", "--continue-on-collection-errors", f"--junitxml={report}"]
    # On a GPU a missing GPU fails every test; a rehearsal lets them skip, having imported each file
    require_gpu = {} if rehearsal else {"ENGINE_REQUIRE_GPU": "1"}
    code = run([sys.executable, "-m", "pytest", "tests/gpu", *options], ENGINE_REQUIRE_DEFAULT_MODEL="1", **require_gpu)
    if not report.is_file():
        return record(result, "pytest tests/gpu", False, f"pytest exit {code}, no JUnit report")
    suite = ElementTree.parse(report).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    skips = "a rehearsal: no GPU, every file imported" if rehearsal else "skips: flash-attn absent"
    detail = (
        f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
        f"({skips}) -> gpu_tests.xml"
    )
    return record(result, "pytest tests/gpu", code == 0, detail, **counts)


def notebook_08(out: Path, result: Path, rehearsal: bool) -> int:
    code = run([sys.executable, "tools/execute_notebooks.py", str(NOTEBOOK), "--save-to", str(out)])
    if code == 0 and not rehearsal:  # a GPU's figures replace the committed ones; a CPU's never do
        shutil.copy(out / NOTEBOOK.name, NOTEBOOK)
    return record(result, "notebook 08 re-executed", code == 0, f"exit {code}" + (f" -> {NOTEBOOK.name}" * (code == 0)))


def benchmark_offline(out: Path, result: Path, rehearsal: bool) -> int:
    report = out / "benchmark_offline.json"
    code = run(
        [
            sys.executable,
            "tools/benchmark_offline.py",
            "--stage",
            "8",
            "--workload",
            "a",
            "--quick",
            "--time-limit",
            "60",
            # the engine twice more, asking for logprobs and penalised: what the options (and the host
            # syncs they add per step, which a CPU cannot show) cost on a GPU
            "--logprobs",
            "5",
            "--penalties",
            "--json",
            str(report),
        ]
    )
    detail = f"exit {code}"
    if report.is_file():
        rows = json.loads(report.read_text())["workloads"]
        detail += "; " + "; ".join(
            f"{w['name']}: " + ", ".join(f"{k} {v}" for k, v in w["ratios"].items()) for w in rows
        )
    return record(result, "stage 8 offline throughput vs transformers", code == 0, detail)


PARTS = {
    "default-model": default_model,
    "gpu-tests": gpu_tests,
    "notebook-08": notebook_08,
    "benchmark-offline": benchmark_offline,
}

if __name__ == "__main__":
    part, out, result = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    sys.exit(PARTS[part](out, result, "--rehearsal" in sys.argv[4:]))
