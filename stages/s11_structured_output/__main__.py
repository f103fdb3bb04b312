"""Stage 11 milestone: JSON that parses, every time.

On the default model (SmolLM2-135M-Instruct), prompts that ask for JSON are sampled with and without
their schema as a grammar; it prints the share of outputs that parse and validate in each case,
one output of each, where the grammar steered one greedy output away from the model's own choice,
and what the mask costs per token beside a decode step.
"""

from __future__ import annotations

import argparse
import os

import torch

from s00_foundation.device import set_torch_threads
from s00_foundation.milestone import add_model_args, load_from_args

from .engine import Engine
from .validity import CASES, mask_cost, mask_walk, validity_rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--samples", type=int, default=4, help="sampled outputs per case and mode")
    args = parser.parse_args()

    threads = set_torch_threads()
    path, device, model, tokenizer = load_from_args(args)
    engine = Engine(model, tokenizer)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model: {path}   torch threads: {threads}   load average: {load:.2f}")
    print(engine.describe().splitlines()[-1] + "\n")
    print(f"{'case':>8s} {'valid, free':>12s} {'valid, grammar':>15s}   one output with the grammar")
    for name, row in validity_rates(engine, samples=args.samples).items():
        print(f"{name:>8s} {row['free']:>12.0%} {row['grammar']:>15.0%}   {row['grammar_example']}")
    prompt, schema = CASES["rating"]
    walk = mask_walk(engine, schema, prompt)
    steered = [f"{step.token!r} for {step.model_choice!r}" for step in walk if step.steered]
    print(f"\nthe grammar steered {len(steered)} of {len(walk)} greedy tokens of 'rating': {', '.join(steered)}")
    prompt, schema = CASES["person"]
    cost = mask_cost(engine, schema, prompt)
    print(
        f"mask per token ({cost['tokens']:.0f} tokens of 'person'): fill {cost['fill_ms']:.3f} ms, "
        f"apply {cost['apply_ms']:.3f} ms; a decode step: {cost['decode_step_ms']:.1f} ms"
    )
    print(f"compilations: {engine.scheduler.grammar_backend.compilations} (one per schema)")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
