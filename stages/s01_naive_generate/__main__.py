"""Stage 1 milestone: real text out of a real model, and how slow recomputing everything is."""

from __future__ import annotations

import argparse
import time

from s00_foundation.device import default_device, describe
from s00_foundation.loader import load_model
from s00_foundation.paths import default_model_path
from s00_foundation.tokenizer import Tokenizer

from .generate import naive_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()

    path = args.model or default_model_path()
    device = args.device or default_device()
    model, tokenizer = load_model(path, device=device), Tokenizer(path)
    prompt_ids = tokenizer.encode_prompt(args.prompt)

    start = time.perf_counter()
    new_ids = naive_generate(model, prompt_ids, args.max_new_tokens, tokenizer.eos_token_ids)
    elapsed = time.perf_counter() - start

    print(f"model: {path}   device: {describe(device)}")
    print(f"prompt ({len(prompt_ids)} tokens): {args.prompt}")
    print(f"output ({len(new_ids)} tokens): {tokenizer.decode(new_ids)}")
    print(f"naive generate: {len(new_ids) / elapsed:.1f} tokens/s ({elapsed:.2f} s; every step recomputes the whole sequence)")


if __name__ == "__main__":
    main()
