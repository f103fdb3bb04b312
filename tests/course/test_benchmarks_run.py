"""The benchmarks the README's figures come from still run (not graded, nothing timed): each one,
on a tiny model and the smallest sizes, finishes and writes what its report is made of. A
refactor of the engine that breaks a tool is caught here, not months later by a reader."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run_tool(name: str, *args: str, timeout: int = 300) -> str:
    done = subprocess.run(
        [sys.executable, str(TOOLS / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, f"{name} {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_offline_benchmark_compares_the_engine_with_transformers(tiny_models_root, tmp_path):
    out = tmp_path / "offline.json"
    args = ["--quick", "--workload", "a", "--model", str(tiny_models_root / "llama"), "--threads", "1"]
    asks = ["--logprobs", "2", "--prompt-logprobs", "1", "--penalties"]
    run_tool("benchmark_offline", *args, *asks, "--no-progress", "--json", str(out))
    [workload] = json.loads(out.read_text())["workloads"]
    assert workload["tokens_per_s"]["engine"] > 0 and workload["ratios"]["engine / transformers static"] > 0
    # asking for logprobs or prompt_logprobs changes no token
    for other in ("transformers static", "engine with logprobs=2", "engine with prompt_logprobs=1"):
        agreement = workload["agreement"][other]
        assert agreement["identical"] == agreement["requests"] == 8, (other, agreement)
    assert workload["ratios"]["engine logprobs=2 time / engine time"] > 0
    assert workload["ratios"]["engine prompt_logprobs=1 time / engine time"] > 0
    assert workload["ratios"]["engine penalised time / engine time"] > 0


def test_the_decode_benchmark_measures_every_cpu_path_and_the_floor(tmp_path):
    out = tmp_path / "decode.json"
    run_tool("benchmark_decode", "--small", "--batch-sizes", "1,2", "--contexts", "16", "--steps", "2",
             "--threads", "1", "--json", str(out))  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch_size"] for row in rows] == [1, 2]
    for row in rows:
        for path in ("loop", "gathered", "table", "batched", "bare", "floor"):
            assert math.isfinite(row[f"{path}_ms"]) and row[f"{path}_ms"] > 0, (path, row)


def test_the_extend_benchmark_compares_the_fused_kernel_with_stage_4():
    out = run_tool("benchmark_extend", "--chunks", "8", "--prefixes", "0,8", "--repeats", "2", "--threads", "1")
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["0", "8"], ["8", "8"])]
    assert len(rows) == 2 and all(row[-1].endswith("x") for row in rows), out


def test_the_serving_benchmark_serves_every_request(tiny_models_root, tmp_path):
    out = tmp_path / "serving.json"
    run_tool("benchmark_serving", "--model", str(tiny_models_root / "llama"), "--num-requests", "4",
             "--input-len", "8", "--output-len", "4", "--rates", "inf", "--json", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    [rate] = result["rates"]
    assert rate["completed"] == 4 and rate["failed"] == 0, rate
    assert rate["throughput_tok_s"] > 0 and result["offline"]["throughput_tok_s"] > 0


def test_the_grammar_benchmark_times_llguidance(default_model_dir):
    out = run_tool("benchmark_grammar")
    for case in ("person", "colors", "rating"):
        assert any(line.strip().startswith(f"{case}: compile") for line in out.splitlines()), out


def test_the_large_bodies_benchmark_posts_each_body_beside_a_stream(tiny_models_root, tmp_path):
    out = tmp_path / "large_bodies.json"
    model = str(tiny_models_root / "llama")
    run_tool("benchmark_large_bodies", "--model", model, "--scale", "0.01", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"messages", "parts", "logit_bias"}
    assert rows["parts"]["status"] == 200 and rows["logit_bias"]["status"] == 400, rows  # keys past its vocabulary
    for name, row in rows.items():
        assert row["status"] in (200, 400), (name, row)
        for key in ("seconds", "models_slowest_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (name, key, row)
        # (the tiny model's stream may end before the post: then there is no gap to report)
        assert row["stream_gap_s"] is None or row["stream_gap_s"] > 0, (name, row)
