"""Stage 1 milestone: real text out of a real model, and how slow recomputing everything is."""

from __future__ import annotations

import argparse
import time

from s00_foundation.device import describe
from s00_foundation.milestone import add_model_args, load_from_args

from .generate import naive_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_args(parser)
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    path, device, model, tokenizer = load_from_args(args)
    prompt_ids = tokenizer.encode_prompt(args.prompt)

    naive_generate(model, prompt_ids, 1)  # warm-up: the first pass loads the C++ kernels (seconds), untimed
    start = time.perf_counter()
    new_ids = naive_generate(model, prompt_ids, args.max_new_tokens, tokenizer.eos_token_ids)
    elapsed = time.perf_counter() - start

    print(f"model: {path}   device: {describe(device)}")
    print(f"prompt ({len(prompt_ids)} tokens): {args.prompt}")
    print(f"output ({len(new_ids)} tokens): {tokenizer.decode(new_ids)}")
    print(
        f"naive generate: {len(new_ids) / elapsed:.1f} tokens/s ({elapsed:.2f} s; every step recomputes the whole "
        "sequence)"
    )


if __name__ == "__main__":
    main()
