"""Stage 10 milestone: the same requests with overlap off and on, and where the time went.

A batch of chat requests decodes on the default model (SmolLM2-135M-Instruct) twice, first with
every step's scheduling and result processing done while the device waits, then overlapped. For
each run it prints the per-step means of the CPU's scheduling, the forward (with sampling) and
the CPU's processing, the share of the CPU's work hidden under a forward, the device's idle share
and the throughput, and checks that both runs produced the same tokens.
"""

from __future__ import annotations

import argparse
import os

import torch

from s00_foundation.device import describe, set_torch_threads
from s00_foundation.milestone import add_model_args, load_from_args
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.__main__ import QUESTIONS

from .overlap_timeline import compare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--requests", type=int, default=16, help="requests in the batch")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens each request generates")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode (the fastest is shown)")
    args = parser.parse_args()

    threads = set_torch_threads()
    path, device, model, tokenizer = load_from_args(args)
    prompts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model: {path}   device: {describe(model.device)}   torch threads: {threads}   load average: {load:.2f}")
    print(
        f"{args.requests} requests x {args.max_new_tokens} new tokens, greedy; "
        f"per step means, fastest of {args.repeats} runs\n"
    )
    results = compare(model, tokenizer, prompts, params, repeats=args.repeats)
    print(
        f"{'overlap':>8s} {'steps':>6s} {'schedule ms':>12s} {'forward ms':>11s} {'process ms':>11s} {'step ms':>8s} "
        f"{'CPU hidden':>11s} {'device idle':>12s} {'tokens/s':>9s}"
    )
    for name, (_, s) in results.items():
        print(
            f"{name:>8s} {s['steps']:>6d} {s['schedule_ms']:>12.2f} {s['forward_ms']:>11.2f} {s['process_ms']:>11.2f} "
            f"{s['step_ms']:>8.2f} {s['hidden']:>10.0%} {s['idle']:>11.0%} {s['tokens_per_s']:>9.1f}"
        )
    off, on = results["off"], results["on"]
    same = [a.output_ids for a in off[0].outputs] == [b.output_ids for b in on[0].outputs]
    print(
        f"\nthroughput, overlap on / off: {on[1]['tokens_per_s'] / off[1]['tokens_per_s']:.2f}x   "
        f"tokens identical: {'yes' if same else 'NO'}"
    )
    if model.device.type != "cuda":
        print(
            "on a CPU the forward and the scheduler share the machine's cores (and Python's GIL between torch ops), "
            "so less is hidden than on a GPU, where the forward runs on the device alone"
        )
    if not same:
        raise SystemExit("the two runs produced different tokens")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
