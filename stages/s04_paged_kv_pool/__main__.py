"""Stage 4 milestone: a static batch of chat prompts of different lengths, out of one KV pool.

Prints each answer, the throughput, and the pool drawn as a strip of slots (one character per
slot, a letter per request) after the prefill and after the first requests finish: the holes
they leave are the fragmentation that the slot table makes harmless.
"""

from __future__ import annotations

import argparse
import string
import time

import torch

from s00_foundation.device import describe
from s00_foundation.milestone import add_model_args, load_from_args
from s02_request_and_sampling.engine import make_output, make_reqs
from s02_request_and_sampling.sampling_params import SamplingParams

from .engine import FREE, PAGE_TAIL, RESERVED, StaticBatchEngine, slots_needed

PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Give me three tips for staying focused while studying at home.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves falling into a quiet river at dusk.",
    "List the planets of the solar system in order from the Sun.",
]


def draw(owner: torch.Tensor, width: int = 96) -> str:
    """The pool as text: A, B, ... = the request in that slot, '.' free, '#' dummy, '-' page tail."""
    chars = {FREE: ".", RESERVED: "#", PAGE_TAIL: "-"}
    text = "".join(chars.get(o, string.ascii_uppercase[o % 26]) for o in owner.tolist())
    return "\n".join("    " + text[i : i + width] for i in range(0, len(text), width))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--pool-size", type=int, default=None, help="KV slots (default: exactly what the batch needs)")
    args = parser.parse_args()

    path, device, model, tokenizer = load_from_args(args)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    reqs = make_reqs(tokenizer, PROMPTS, params)
    pool_size = args.pool_size or slots_needed(reqs, args.page_size)
    engine = StaticBatchEngine(model, pool_size=pool_size, page_size=args.page_size, max_running_requests=len(reqs))
    kv_bytes = model.config.kv_bytes_per_token(model.dtype)

    print(f"model: {path}   device: {describe(device)}   attention: {engine.runner.attention_backend_name}")
    print(
        f"pool: {pool_size} slots x {kv_bytes / 1024:.1f} KiB per token = {pool_size * kv_bytes / 2**20:.1f} MiB, "
        f"page size {args.page_size}; {len(reqs)} requests, prompts of {[len(r.origin_input_ids) for r in reqs]} tokens"
    )

    start, steps, pictures = time.perf_counter(), 0, []
    engine.add_requests(reqs)
    with torch.inference_mode():
        while engine.running:
            finished = engine.step()
            steps += 1
            used = pool_size - engine.runner.allocator.available_size()
            if steps == 1:
                pictures.append(
                    (
                        f"after the prefill (one ragged pass of {sum(len(r.origin_input_ids) for r in reqs)} tokens): "
                        f"{used}/{pool_size} slots in use",
                        draw(engine.slot_map()),
                    )
                )
            elif finished and len(pictures) == 1 and engine.running:
                names = ", ".join(string.ascii_uppercase[reqs.index(r)] for r in finished)
                whose = "its" if len(finished) == 1 else "their"
                pictures.append(
                    (
                        f"step {steps}: {names} finished and freed {whose} slots; {used}/{pool_size} in use",
                        draw(engine.slot_map()),
                    )
                )
    elapsed = time.perf_counter() - start

    outputs = [make_output(req) for req in reqs]
    print()
    for letter, prompt, out in zip(string.ascii_uppercase, PROMPTS, outputs):
        print(f"[{letter}] {prompt}\n    -> {out.text.strip()!r} ({out.output_tokens} tokens, {out.finish_reason})")
    print()
    for title, picture in pictures:
        print(title)
        print(picture)
    total = sum(out.output_tokens for out in outputs)
    print(
        f"\n{total} tokens in {steps} steps, {elapsed:.2f} s = {total / elapsed:.1f} tokens/s "
        f"(one forward pass per step for the whole batch)"
    )
    print(f"after the batch: {engine.runner.allocator.available_size()}/{pool_size} slots free")
    engine.runner.allocator.check_invariants(owners=[])


if __name__ == "__main__":
    main()
