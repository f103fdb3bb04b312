"""Stage 8 milestone: decode step latency vs batch size: stage 4's loop, the batched decode, the
CUDA graph, and the bare model pass.

For each batch size, one decode step of the default model (SmolLM2-135M-Instruct; bfloat16 on a
GPU, float32 on a CPU) on each path, and the speed-ups. On a CPU there is nothing to capture: it
says so and leaves the graph out (the graph path's buffers and padding are exercised by the tests
and shown in notebook 08), and shows the batched decode three ways: over the gathered block,
through the table (table_attention.py), and by the fused kernel (decode_kernel.py), as the engine
runs it there.
"""

from __future__ import annotations

import argparse

from s00_foundation.device import describe, set_torch_threads
from s00_foundation.milestone import add_model_args, model_from_args

from .decode_latency import bare_forward_latency, decode_step_latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument(
        "--batch-sizes", default=None, help="comma-separated (default: 1..64 on a GPU, 1,4,16 on a CPU)"
    )
    parser.add_argument("--context-len", type=int, default=128, help="tokens in context per request")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size (the median is shown)")
    args = parser.parse_args()

    set_torch_threads()
    path, device, model = model_from_args(args)
    on_gpu = model.device.type == "cuda"
    sizes = [int(s) for s in (args.batch_sizes or ("1,2,4,8,16,32,64" if on_gpu else "1,4,16")).split(",")]
    paths = ["loop", "batched", "graph"] if on_gpu else ["loop", "gathered", "table", "batched"]
    print(f"model: {path}   dtype: {str(model.dtype).removeprefix('torch.')}   device: {describe(model.device)}")
    print(
        f"one decode step (runner.forward) of N requests with ~{args.context_len} tokens in context each; "
        f"median of {args.steps} steps; bare = the model pass without attention and KV pool (the ceiling)"
    )
    if not on_gpu:
        print(
            "no CUDA GPU here: nothing to capture, so the graph path is left out; gathered = one SDPA per layer "
            "over the gathered keys, table = through the table, batched = as the engine runs it (the fused kernel "
            "when it built)"
        )
    print(
        "\n"
        + f"{'batch':>6s}"
        + "".join(f" {p + ' ms':>11s}" for p in paths + ["bare"])
        + f" {'loop/batched':>13s}"
        + (f" {'graph speed-up':>15s}" if on_gpu else "")
    )
    for bs in sizes:
        ms = {p: 1000 * decode_step_latency(model, bs, args.context_len, p, steps=args.steps)["seconds"] for p in paths}
        ms["bare"] = 1000 * bare_forward_latency(model, bs, args.context_len, steps=args.steps)
        line = f"{bs:>6d}" + "".join(f" {v:>11.2f}" for v in ms.values()) + f" {ms['loop'] / ms['batched']:>12.2f}x"
        if on_gpu:
            line += f" {ms['batched'] / ms['graph']:>14.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
