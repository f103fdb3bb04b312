"""One prepared check of stage 8's CUDA path, sized for a borrowed GPU: `make gpu-check`.

    python3 tools/gpu_check.py --out DIR               # on the GPU: model-free, ~5 minutes
    python3 tools/gpu_check.py --out DIR --rehearsal   # the same steps on a CPU (no capture: eager)
    python3 tools/gpu_check.py --out DIR --full        # second run: default model, GPU tests, notebook 08
    python3 tools/gpu_check.py --out DIR --full --rehearsal   # its parts on a CPU (the GPU tests skip)

It needs only a Python with torch (and, for --full, what tools/offline_bundle.py carries): no
virtual env, no default model, nothing downloaded. The models are built from local configs with
random weights: one of SmolLM2-135M's shape, one of Qwen3-0.6B's (gpu_check_steps.py).

Each step runs in its own process under its own timeout (a hung kernel cannot eat the GPU
time of the steps after it), in float32 and bfloat16:

    graphs-*      capture at start (time, memory), graph vs eager logits for every bucket
                  (bfloat16: each against a float32 twin), earlier graphs replayed after later
                  ones, padded rows write only the dummy slot
    engine-*      a stage-8 engine's tokens with graphs equal those without (float32: with every
                  sampling option too, and their logprobs)
    sdpa-kernel   which SDPA kernel the graph decode selects, and which others would run;
                  attention at new lengths costs what repeated ones do (no plan per shape);
                  measured for later choices: cuDNN's attention inside a graph, GQA by kernel
    decode-latency  one decode step: stage 4's loop vs batched eager vs graph, batch 1, 8, 32, 64
    overlap       stage 10's overlapped engine on its CUDA stream: stage 8's tokens, throughput

Everything it produces lands in DIR, at most 8 files and no subfolder (what a GPU machine's
output folder brings back): summary.txt (the versions first, then PASS/FAIL per step and check,
then how to read it), results.json (every figure), junit.xml, log.txt (each step's output).
The exit status is 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


@dataclass
class Step:
    name: str
    timeout: float  # seconds on a GPU (the whole check stays under 7 minutes)
    what: str


STEPS = [
    Step("graphs-float32", 90, "capture at start, graph vs eager logits per bucket, replays, dummy slot (float32)"),
    Step("graphs-bfloat16", 120, "the same in bfloat16, graph and eager each against a float32 twin"),
    Step("engine-float32", 45, "a stage-8 engine's tokens, graphs vs no graphs (float32: identical), options too"),
    Step("engine-bfloat16", 45, "the same in bfloat16 (a difference only where eager's top two logits tie)"),
    Step("sdpa-kernel", 45, "the SDPA kernel the graph decode selects; which others accept its shapes; new lengths"),
    Step("decode-latency", 110, "decode step latency: stage 4's loop, batched eager, graph; batch 1, 8, 32, 64"),
    Step("overlap", 60, "stage 10's overlapped engine (worker stream, graphs): stage 8's tokens; throughput off vs on"),
]
# The second run (--full): with the default model installed from the offline bundle. The test
# suite, the longest part, comes last: a slow one cannot starve the notebook or the benchmark.
FULL_PARTS = [
    Step("default-model", 120, "convert the default model (tools/setup_model.py)"),
    Step("notebook-08", 150, "notebook 08 re-executed (on a GPU: saved in place, and copied here)"),
    Step(
        "benchmark-offline", 120, "stage 8 offline throughput vs transformers, --quick; what logprobs, penalties cost"
    ),
    Step("gpu-tests", 330, "the GPU test suite (pytest tests/gpu; on a GPU, ENGINE_REQUIRE_GPU=1)"),
]
TOTAL_BUDGET = 400  # seconds: a step never gets more than what is left of this
# The second run shares its call (10 minutes at most) with installing the bundle's last load, so
# its parts, whose own limits add up to 12 minutes, share 9: the summary is always written.
FULL_BUDGET = 540
HOW_TO_READ = """how to read this:
  - the first lines say what ran: GPU, driver, Python, torch, CUDA, cuDNN;
  - one line per step: PASS, FAIL (a check failed), TIMEOUT (killed at its limit) or ERROR (it
    crashed); under it one line per check with its figures; log.txt has each step's full output;
  - results.json holds every figure (per bucket, per batch size), junit.xml the same as test cases;
  - after a GPU run: commit nothing from here by hand; copy the figures into the issue notes
    (with the GPU's name) and run the second command (make gpu-check-full) for notebook 08."""


# --- what this machine is ------------------------------------------------------------------------


def command_output(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(rehearsal: bool) -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu": platform.processor() or platform.machine(),
        "glibc": platform.libc_ver()[1] or None,  # which wheels it takes (offline_bundle.py pack)
        "torch_threads": torch.get_num_threads(),
        "rehearsal": rehearsal,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except Exception:  # absent, or built for another torch
        env["flash_attn"] = None
    # What this Python already holds: tools/offline_bundle.py pack --target-env leaves these out.
    env["packages"] = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions() if d.metadata["Name"]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = (
            f"{props.name} ({props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor})"
        )
        env["driver"] = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return env


def environment_lines(env: dict) -> list[str]:
    device = env.get("gpu") or f"none (CPU: {env['cpu']}, {env['torch_threads']} torch threads)"
    return [
        f"GPU: {device}   driver: {env.get('driver') or 'n/a'}",
        f"Python {env['python']} ({env['executable']})   torch {env['torch']}   CUDA {env['cuda']}   cuDNN "
        f"{env['cudnn']}",
        f"transformers {env['transformers']}   flash-attn {env['flash_attn'] or 'not installed'}",
        f"offline bundle for this machine (Python {'.'.join(env['python'].split('.')[:2])}, "
        f"{len(env['packages'])} packages): python tools/offline_bundle.py pack --only packages "
        "--target-env results.json",
    ]


# --- running the steps, each in its own process ------------------------------------------------


def run_step(step: Step, argv: list[str], timeout: float, result_file: Path, log, env_vars: dict | None = None) -> dict:
    """Run one step as a child process (its own process group, so a timeout kills all of it);
    its output goes to the log, its checks come back through ``result_file``."""
    log.write(f"\n===== {step.name}: {step.what} (timeout {timeout:.0f} s)\n$ {' '.join(argv)}\n")
    log.flush()
    start = time.perf_counter()
    child = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
        env={**os.environ, **(env_vars or {})},
    )
    try:
        code = child.wait(timeout=max(timeout, 1))
        status = None
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        code, status = None, "TIMEOUT"
    seconds = time.perf_counter() - start
    checks = json.loads(result_file.read_text()) if result_file.is_file() and result_file.stat().st_size else []
    if status is None:
        failed = [c for c in checks if c["status"] == "FAIL"]
        status = "PASS" if code == 0 and not failed else ("FAIL" if failed else "ERROR")
    log.write(f"===== {step.name}: {status} in {seconds:.1f} s (exit {code})\n")
    log.flush()
    return {
        "step": step.name,
        "what": step.what,
        "status": status,
        "seconds": round(seconds, 2),
        "exit_code": code,
        "checks": checks,
    }


def junit(results: list[dict], suite: str) -> str:
    cases = []
    for step in results:
        checks = step["checks"] or [
            {"check": "(step)", "status": step["status"], "detail": f"{step['status']} with no checks reported"}
        ]
        if step["status"] in ("TIMEOUT", "ERROR"):
            checks = checks + [
                {"check": "(step)", "status": "FAIL", "detail": f"{step['status']} after {step['seconds']} s"}
            ]
        for check in checks:
            body = ""
            if check["status"] == "FAIL":
                body = f"<failure message={quoteattr(check['detail'][:500])}>{escape(check['detail'])}</failure>"
            elif check["status"] == "SKIP":
                body = f"<skipped message={quoteattr(check['detail'][:500])}/>"
            cases.append(
                f'  <testcase classname="{suite}.{step["step"]}" name={quoteattr(check["check"])}>{body}</testcase>'
            )
    failures = sum("<failure" in c for c in cases)
    return (
        f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="{suite}" tests="{len(cases)}" '
        f'failures="{failures}">\n' + "\n".join(cases) + "\n</testsuite>\n"
    )


def write_summary(out: Path, title: str, env: dict, results: list[dict], how_to_read: str) -> str:
    passed = sum(r["status"] == "PASS" for r in results)
    lines = [title, *environment_lines(env), ""]
    for r in results:
        lines.append(f"{r['status']:7s} {r['step']} ({r['seconds']:.1f} s): {r['what']}")
        lines += [f"          {c['status']:4s} {c['check']}: {c['detail']}" for c in r["checks"]]
    verdict = "PASS" if passed == len(results) else "FAIL"
    lines += ["", f"overall: {verdict} ({passed} of {len(results)} steps passed)", "", how_to_read, ""]
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="the output folder (created; its files are replaced)")
    parser.add_argument("--rehearsal", action="store_true", help="run the steps on a CPU: no capture, small models")
    parser.add_argument("--quick", action="store_true", help="fewer buckets and batch sizes (the course's own test)")
    parser.add_argument("--full", action="store_true", help="the second run: default model, GPU tests, notebook 08")
    parser.add_argument("--steps", default=None, help="comma-separated subset of the steps (default: all)")
    parser.add_argument(
        "--step-timeout", action="append", default=[], metavar="NAME=SECONDS", help="override one step's timeout"
    )
    parser.add_argument("--run-step", default=None, help=argparse.SUPPRESS)  # internal: run one step in this process
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_step:  # a child process: one step
        import gpu_check_steps

        return gpu_check_steps.run(args.run_step, args.result, rehearsal=args.rehearsal, quick=args.quick)

    if args.out is None:
        parser.error("--out DIR is required: the folder the summary, results, JUnit file and log go to")
    import torch

    if not args.rehearsal and not torch.cuda.is_available():
        parser.error(
            f"no CUDA GPU (torch {torch.__version__} sees none): on a CPU run the rehearsal (--rehearsal, "
            "make gpu-check REHEARSAL=1)"
        )
    steps = FULL_PARTS if args.full else STEPS
    if args.steps:
        wanted = args.steps.split(",")
        unknown = sorted(set(wanted) - {s.name for s in steps})
        if unknown:
            parser.error(f"unknown step(s) {unknown}; the steps are {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in wanted]
    overrides = {}
    for item in args.step_timeout:
        name, _, seconds = item.partition("=")
        if name not in {s.name for s in steps} or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--step-timeout {item!r}: want NAME=SECONDS with NAME one of {[s.name for s in steps]}")
        overrides[name] = float(seconds)

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.rehearsal)
    kind = "second run (--full)" if args.full else "GPU run"
    if args.rehearsal:
        kind = "CPU rehearsal" + " of the second run (--full)" * args.full
    title = f"gpu-check, {kind}, {time.strftime('%Y-%m-%d %H:%M:%S')}"
    print(title, *environment_lines(env), sep="\n", flush=True)
    results, deadline = [], time.monotonic() + (FULL_BUDGET if args.full else TOTAL_BUDGET)
    with tempfile.TemporaryDirectory() as tmp, (out / "log.txt").open("w") as log:
        for step in steps:
            timeout = overrides.get(step.name, step.timeout)
            if args.rehearsal:
                timeout *= 3  # a CPU is slower, and nobody pays for its minutes
            else:
                timeout = min(timeout, max(deadline - time.monotonic(), 1))
            result_file = Path(tmp) / f"{step.name}.json"
            if args.full:
                import gpu_check_full

                argv_step, env_vars = gpu_check_full.command(step.name, out, result_file, args.rehearsal)
            else:
                argv_step = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--run-step",
                    step.name,
                    "--result",
                    str(result_file),
                ]
                argv_step += ["--rehearsal"] * args.rehearsal + ["--quick"] * args.quick
                env_vars = None
            result = run_step(step, argv_step, timeout, result_file, log, env_vars)
            results.append(result)
            print(f"{result['status']:7s} {step.name} ({result['seconds']:.1f} s)", flush=True)
    (out / "results.json").write_text(json.dumps({"title": title, "environment": env, "steps": results}, indent=1))
    (out / "junit.xml").write_text(junit(results, "gpu_check_full" if args.full else "gpu_check"))
    how_to_read = gpu_check_full_how_to_read(args.rehearsal) if args.full else HOW_TO_READ
    verdict = write_summary(out, title, env, results, how_to_read)
    print(
        f"\n{verdict}: {out / 'summary.txt'} (and results.json, junit.xml, log.txt"
        f"{', the GPU tests, notebook 08' if args.full else ''})"
    )
    print(how_to_read)
    return 0 if verdict == "PASS" else 1


def gpu_check_full_how_to_read(rehearsal: bool) -> str:
    import gpu_check_full

    if rehearsal:
        return (
            gpu_check_full.HOW_TO_READ
            + "\n  - this was a CPU rehearsal: no figure here is a GPU's; commit nothing from it."
        )
    return gpu_check_full.HOW_TO_READ


if __name__ == "__main__":
    sys.exit(main())
