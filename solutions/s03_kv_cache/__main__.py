"""Stage 3 milestone: the same prompt, naive (stage 1) vs cached generation.

The tokens must be identical (the cache changes the cost, not the result), and the cached
run is far faster because each step computes one token instead of the whole sequence.
"""

from __future__ import annotations

import argparse
import time

from s00_foundation.device import describe
from s00_foundation.milestone import add_model_args, load_from_args
from s01_naive_generate.generate import naive_generate

from .generate import cached_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens tokens")
    args = parser.parse_args()

    path, device, model, tokenizer = load_from_args(args)
    prompt_ids = tokenizer.encode_prompt(args.prompt)
    eos = () if args.ignore_eos else tokenizer.eos_token_ids
    cached_generate(model, prompt_ids, 2, eos)  # warm-up: first calls pay for allocator and kernel setup

    timings = {}
    for name, fn in (("naive (stage 1)", naive_generate), ("cached (stage 3)", cached_generate)):
        start = time.perf_counter()
        ids = fn(model, prompt_ids, args.max_new_tokens, eos)
        timings[name] = (ids, time.perf_counter() - start)

    (naive_ids, naive_s), (cached_ids, cached_s) = timings.values()
    print(f"model: {path}   device: {describe(device)}")
    print(f"prompt ({len(prompt_ids)} tokens): {args.prompt}")
    print(f"output ({len(cached_ids)} tokens): {tokenizer.decode(cached_ids)}")
    print()
    for name, (ids, seconds) in timings.items():
        print(f"{name:17s} {len(ids):4d} tokens in {seconds:6.2f} s = {len(ids) / seconds:7.1f} tokens/s")
    same = naive_ids == cached_ids
    print(f"tokens identical: {same}")
    print(
        f"speedup of the KV cache: {naive_s / cached_s:.1f}x "
        f"(grows with the length: naive step t recomputes {len(prompt_ids)} + t tokens, cached computes 1)"
    )
    if not same:
        raise SystemExit("naive and cached generation disagree: the cache changed the result")


if __name__ == "__main__":
    main()
