"""Stage 8 milestone: decode step latency vs batch size, eager vs CUDA graph.

On a GPU: for each batch size, one decode step of the default model (SmolLM2-135M-Instruct,
bfloat16) run eagerly and replayed from the bucket's graph, and the speed-up. On a CPU there is
nothing to capture: it says so and shows the eager numbers only (the graph path's buffers and
padding are exercised by the tests and shown in notebook 08).
"""

from __future__ import annotations

import argparse

from s00_foundation.device import describe
from s00_foundation.milestone import add_model_args, model_from_args

from .decode_latency import decode_step_latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default: 1..64 on a GPU, 1,2,4,8 on a CPU)")
    parser.add_argument("--context-len", type=int, default=128, help="tokens in context per request")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size (the median is shown)")
    args = parser.parse_args()

    path, device, model = model_from_args(args)
    on_gpu = model.device.type == "cuda"
    default_sizes = "1,2,4,8,16,32,64" if on_gpu else "1,2,4,8"
    sizes = [int(s) for s in (args.batch_sizes or default_sizes).split(",")]
    print(f"model: {path}   dtype: {str(model.dtype).removeprefix('torch.')}   device: {describe(model.device)}")
    print(f"one decode step (runner.forward) of N requests with ~{args.context_len} tokens in context each; "
          f"median of {args.steps} steps")
    if not on_gpu:
        print("no CUDA GPU here: nothing to capture, so only the eager numbers are shown\n")
        print(f"{'batch':>6s} {'eager ms/step':>14s} {'tokens/s':>10s}")
        for bs in sizes:
            eager = decode_step_latency(model, bs, args.context_len, use_graph=False, steps=args.steps)["seconds"]
            print(f"{bs:>6d} {1000 * eager:>14.2f} {bs / eager:>10.0f}")
        return
    print(f"\n{'batch':>6s} {'eager ms/step':>14s} {'graph ms/step':>14s} {'speed-up':>9s} {'bucket':>11s}")
    for bs in sizes:
        eager = decode_step_latency(model, bs, args.context_len, use_graph=False, steps=args.steps)
        graph = decode_step_latency(model, bs, args.context_len, use_graph=True, steps=args.steps)
        print(f"{bs:>6d} {1000 * eager['seconds']:>14.2f} {1000 * graph['seconds']:>14.2f} "
              f"{eager['seconds'] / graph['seconds']:>8.2f}x {str(graph['bucket']):>11s}")


if __name__ == "__main__":
    main()
