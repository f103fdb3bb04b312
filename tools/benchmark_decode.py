"""Decode step latency per batch size and context: stage 4's loop, stage 8's eager decode over the
gathered block, through the table and as the engine runs it (on a CPU: the fused kernel), the CUDA
graph, and the bare model forward (the ceiling), side by side.

For each batch size and context length it gives that many requests their context (random K/V
written into the pool, no prefill), warms up, and reports the median ``runner.forward`` time of a
decode step on each path (s08 decode_latency.py), and the bare forward of the same batch
(attention and KV pool taken out): "batched / bare" is what a decode step costs beyond the
model's own matrix products. "floor" adds to the bare pass one read of the step's K/V at the rate
this device streams memory (measured here, first): no attention reads less, so "batched / floor"
is what is left to win. Nothing is asserted.

The model is random-weight, of a real shape built here (nothing downloaded; latency does not
depend on the weights' values): Qwen3-0.6B's by default, SmolLM2-135M's (the default model's)
with --shape smollm2, a 4-layer stand-in with --small. On a CPU there is nothing to capture: the
graph path runs its padded static batch eagerly, and it is left out unless --paths asks for it;
on a GPU "gathered" is what "batched" runs, and it and "table" are left out.

    python tools/benchmark_decode.py                                        # GPU: bs 1..64, context 512
    python tools/benchmark_decode.py --shape smollm2 --batch-sizes 16,32,64 --contexts 128,512,1024   # CPU
    python tools/benchmark_decode.py --small                                 # a CPU smoke run in seconds
    python tools/benchmark_decode.py --json reports/benchmark_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import impl_switch  # noqa: E402

SWITCH = impl_switch.install()

import torch  # noqa: E402

from s00_foundation.device import default_device, default_dtype, describe, set_torch_threads  # noqa: E402
from s08_cuda_graph.decode_latency import (  # noqa: E402
    PATHS,
    QWEN3_0_6B,
    SMALL_QWEN3,
    SMOLLM2_135M,
    bare_forward_latency,
    decode_step_latency,
    memory_floor,
    memory_read_rate,
    random_model,
)

SHAPES = {"qwen3": QWEN3_0_6B, "smollm2": SMOLLM2_135M}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3", help="whose shape (default: Qwen3-0.6B)")
    parser.add_argument(
        "--small", action="store_true", help="a 4-layer stand-in of Qwen3's family (for a quick CPU run)"
    )
    parser.add_argument(
        "--batch-sizes", default=None, help="comma-separated (default: 1,2,4,8,16,32,64; --small 1,2,4,8)"
    )
    parser.add_argument(
        "--contexts", default=None, help="tokens in context per request, comma-separated (default 512; --small 64)"
    )
    parser.add_argument(
        "--paths",
        default=None,
        help=f"comma-separated of {','.join(PATHS)} (default: loop,batched,graph on a GPU; "
        "loop,gathered,table,batched on a CPU)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per point (the median is reported)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the device's)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: one per physical core)")
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="compile each layer's MLP and RMSNorms (stage 8; attention stays eager)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    threads = set_torch_threads(args.threads)

    device = torch.device(args.device) if args.device else default_device()
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(device)
    on_gpu = device.type == "cuda"
    shape = SMALL_QWEN3 if args.small else SHAPES[args.shape]
    sizes = [int(s) for s in (args.batch_sizes or ("1,2,4,8" if args.small else "1,2,4,8,16,32,64")).split(",")]
    contexts = [int(c) for c in (args.contexts or ("64" if args.small else "512")).split(",")]
    paths = (args.paths or ("loop,batched,graph" if on_gpu else "loop,gathered,table,batched")).split(",")
    if not set(paths) <= set(PATHS):
        parser.error(f"--paths takes {PATHS}, got {paths}")
    model = random_model(shape, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    name = "a small stand-in of Qwen3's family" if args.small else f"{args.shape}'s shape"
    print(
        f"model: {name}, random weights ({params / 1e6:.0f}M parameters, {shape['num_hidden_layers']} layers)  "
        f"dtype: {str(dtype).removeprefix('torch.')}  device: {describe(device)}  load average {os.getloadavg()[0]:.2f}"
    )
    read_rate = memory_read_rate(device)
    print(SWITCH.describe())
    print(f"memory read rate: {read_rate / 1e9:.1f} GB/s (a sum over 512 MiB, best of 5)")
    print(
        f"one decode step (runner.forward) of N requests; median of {args.steps} steps; bare = the model pass "
        "without attention" + ("; torch.compile on" if args.torch_compile else "")
    )

    rows = []
    header = (
        f"{'batch':>6s} {'context':>8s}"
        + "".join(f" {p + ' ms':>11s}" for p in paths)
        + f" {'bare ms':>9s} {'floor ms':>9s}"
    )
    if "batched" in paths:
        header += f" {'batched/bare':>13s} {'batched/floor':>14s}"
    if "graph" in paths and "batched" in paths:
        header += f" {'graph speed-up':>15s}"
    print("\n" + header)
    for context_len in contexts:
        for bs in sizes:
            row: dict[str, Any] = {"batch_size": bs, "context_len": context_len}
            line = f"{bs:>6d} {context_len:>8d}"
            for path in paths:
                result = decode_step_latency(
                    model, bs, context_len, path, steps=args.steps, enable_torch_compile=args.torch_compile
                )
                row[f"{path}_ms"] = 1000 * result["seconds"]
                if path == "graph":
                    row["bucket"] = result["bucket"]
                line += f" {row[f'{path}_ms']:>11.3f}"
            row["bare_ms"] = 1000 * bare_forward_latency(model, bs, context_len, steps=args.steps)
            row["floor_ms"] = 1000 * memory_floor(model, bs, context_len, row["bare_ms"] / 1000, read_rate)
            line += f" {row['bare_ms']:>9.3f} {row['floor_ms']:>9.3f}"
            if "batched" in paths:
                row["batched_over_bare"] = row["batched_ms"] / row["bare_ms"]
                row["batched_over_floor"] = row["batched_ms"] / row["floor_ms"]
                line += f" {row['batched_over_bare']:>12.2f}x {row['batched_over_floor']:>13.2f}x"
            if "graph" in paths and "batched" in paths:
                row["graph_speedup"] = row["batched_ms"] / row["graph_ms"]
                line += f" {row['graph_speedup']:>14.2f}x"
            rows.append(row)
            print(line, flush=True)
    print(f"\nattention backend: {result['backend']}; torch threads {threads}; load average {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": describe(device),
                    "dtype": str(dtype),
                    "model": name,
                    "torch_threads": threads,
                    "steps": args.steps,
                    "memory_read_gb_per_s": read_rate / 1e9,
                    "rows": rows,
                },
                indent=2,
            )
        )
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
