"""Stage 12 milestone: the same requests on 1 rank and on --tp-size ranks, the same tokens,
and where a step's time goes (compute vs communication).

The model is split over N processes (gloo on a CPU, one torch thread per rank; NCCL on GPUs).
For each run it prints the per-step means of rank 0's forward, split into compute and the
collectives' communication, the step and the throughput, and checks both runs produced the same
greedy tokens. It also runs under torchrun: ``torchrun --nproc-per-node 3 -m s12_tensor_parallel``
(rank 0 runs this milestone, the other ranks the follower loop).
"""

from __future__ import annotations

import argparse
import os

import torch

from s00_foundation.device import describe, physical_cores, set_torch_threads
from s00_foundation.paths import default_model_path
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.__main__ import QUESTIONS

from .launch import launched_by_torchrun
from .tp_timing import measure
from .tp_worker import follower_main


def main() -> None:
    if launched_by_torchrun() and os.environ.get("RANK") != "0":
        raise SystemExit(follower_main())  # torchrun started this rank: it only runs the forward
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument(
        "--tp-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", 3)),
        help="ranks of the tensor-parallel run (SmolLM2-135M: 9 query heads, 3 KV heads)",
    )
    parser.add_argument("--requests", type=int, default=8, help="requests in the batch")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens each request generates")
    args = parser.parse_args()

    threads = set_torch_threads()
    model = str(args.model or default_model_path())
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"model: {model}   device: {describe(device)} per rank   load average: {load:.2f}")
    print(f"{args.requests} requests x {args.max_new_tokens} new tokens, greedy; per step means (rank 0)\n")
    columns = ("tp", 3), ("steps", 6), ("compute ms", 11), ("comm ms", 8), ("forward ms", 11), ("step ms", 8)
    print(" ".join(f"{name:>{width}s}" for name, width in columns), f"{'tokens/s':>9s}")
    runs = [measure(model, tp, prompts, params, device=args.device) for tp in (1, args.tp_size)]
    for r in runs:
        print(
            f"{r['tp']:>3d} {r['steps']:>6d} {r['compute_ms']:>11.2f} {r['comm_ms']:>8.2f} {r['forward_ms']:>11.2f} "
            f"{r['step_ms']:>8.2f} {r['tokens_per_s']:>9.1f}"
        )
    same = runs[0]["output_ids"] == runs[1]["output_ids"]
    print(f"\ntokens identical: {'yes' if same else 'NO'}   (threads per rank: {threads})")
    if device.type != "cuda":
        print(cpu_verdict(runs, threads, physical_cores()))
    if not same:
        raise SystemExit("the two runs produced different tokens")


def cpu_verdict(runs: list[dict], threads: int, cores: int) -> str:
    """What the two CPU runs say: the speed ratio, and why (a rank without a core of its own
    makes every other rank wait for it at each collective)."""
    tp = runs[1]["tp"]
    ratio = runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
    if tp * threads > cores:
        why = (
            f"its {tp} ranks of {threads} thread(s) share {cores} physical core(s), so at every all-reduce some "
            "rank is still waiting for a core and the others wait for it: most of 'comm ms' is that waiting"
        )
    else:
        why = (
            "each rank has a core of its own; every collective is a round trip through gloo over local TCP "
            "(tens of microseconds, 2 per layer), against a small model's short per-rank compute"
        )
    return (
        f"tp={tp} ran at {ratio:.2f}x the speed of one rank on this CPU: {why}. On GPUs joined by NVLink an "
        "all-reduce of a decode step's hidden state takes a few microseconds, and each rank computes 1/tp of the work"
    )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
