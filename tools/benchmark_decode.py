"""Decode step latency, eager vs CUDA graph (stage 8), for batch sizes 1..64.

The model has Qwen3-0.6B's shape (28 layers, hidden 1024, 16 query / 8 KV heads of 128, vocabulary
151936, tied embeddings) with random weights: the config is built here, nothing is downloaded, and
latency does not depend on the weights' values. For each batch size it prefills that many requests
of ``--context-len`` random tokens, warms up (on CUDA the bucket's graph is captured then) and
reports the median ``runner.forward`` time of a decode step, eager (graphs disabled) and graph
(replayed), side by side with the ratio. Nothing is asserted: the numbers depend on the machine.

On a CPU there is nothing to capture: only the eager path is timed (it says so), and ``--small``
swaps in a 4-layer stand-in so the run takes seconds.

    python tools/benchmark_decode.py                      # GPU: Qwen3-0.6B shape, bf16, bs 1..64
    python tools/benchmark_decode.py --small              # CPU: a small stand-in, bs 1..8
    python tools/benchmark_decode.py --json reports/benchmark_decode.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import impl_switch  # noqa: E402

SWITCH = impl_switch.install()

import torch  # noqa: E402

from s00_foundation.device import default_device, default_dtype, describe  # noqa: E402
from s08_cuda_graph.decode_latency import QWEN3_0_6B, SMALL_QWEN3, decode_step_latency, random_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default: 1,2,4,8,16,32,64; with --small 1,2,4,8)")
    parser.add_argument("--context-len", type=int, default=None, help="tokens in context per request (default 512; --small 64)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per point (the median is reported)")
    parser.add_argument("--small", action="store_true", help="a 4-layer stand-in of the same family (for a CPU)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device) if args.device else default_device()
    dtype = default_dtype(device)
    on_gpu = device.type == "cuda"
    shape = SMALL_QWEN3 if args.small else QWEN3_0_6B
    sizes = [int(s) for s in (args.batch_sizes or ("1,2,4,8" if args.small else "1,2,4,8,16,32,64")).split(",")]
    context_len = args.context_len or (64 if args.small else 512)
    model = random_model(shape, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {'a small stand-in of ' if args.small else ''}Qwen3-0.6B's shape, random weights ({params / 1e6:.0f}M parameters, "
          f"{shape['num_hidden_layers']} layers)  dtype: {str(dtype).removeprefix('torch.')}  device: {describe(device)}")
    print(SWITCH.describe())
    print(f"one decode step (runner.forward) of N requests with ~{context_len} tokens in context; median of {args.steps} steps")
    if not on_gpu:
        print("no CUDA GPU: nothing to capture, only the eager path is timed")

    rows = []
    header = f"{'batch':>6s} {'eager ms':>9s} {'tokens/s':>9s}"
    print("\n" + header + (f" {'graph ms':>9s} {'tokens/s':>9s} {'speed-up':>9s} {'bucket':>11s}" if on_gpu else ""))
    for bs in sizes:
        eager = decode_step_latency(model, bs, context_len, use_graph=False, steps=args.steps)
        row = {"batch_size": bs, "eager_ms": 1000 * eager["seconds"]}
        line = f"{bs:>6d} {row['eager_ms']:>9.3f} {bs / eager['seconds']:>9.0f}"
        if on_gpu:
            graph = decode_step_latency(model, bs, context_len, use_graph=True, steps=args.steps)
            assert graph["path"] == "graph", f"batch {bs}: the graph run took the {graph['path']} path"
            row.update(graph_ms=1000 * graph["seconds"], speedup=eager["seconds"] / graph["seconds"], bucket=graph["bucket"])
            line += f" {row['graph_ms']:>9.3f} {bs / graph['seconds']:>9.0f} {row['speedup']:>8.2f}x {str(graph['bucket']):>11s}"
        rows.append(row)
        print(line, flush=True)
    print(f"\nattention backend: {eager['backend']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "device": describe(device), "dtype": str(dtype), "model": "qwen3-0.6b-shape" + ("-small" if args.small else ""),
            "context_len": context_len, "steps": args.steps, "attention_backend": eager["backend"],
            "rows": rows,
        }, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
