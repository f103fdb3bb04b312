"""Stage 5 milestone: sixteen chat requests of mixed lengths through the continuous-batching engine.

Prints every answer with its stats (prompt and output tokens, finish reason, time to first token,
latency), then the throughput and the peak running batch size. With --trace, one line per step
shows the batch breathe: requests admitted as others finish, prefills riding along with decodes.
"""

from __future__ import annotations

import argparse
import time

from s00_foundation.device import describe
from s00_foundation.milestone import add_model_args, load_from_args
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool.__main__ import PROMPTS

from .engine import Engine

QUESTIONS = PROMPTS + [  # stage 4's six, and ten more
    "What is 12 times 7?",
    "Describe a cat to someone who has never seen one.",
    "Translate 'good morning' into Spanish, French and German.",
    "Why do we have seasons on Earth? Keep it short.",
    "Suggest a name for a small bakery that sells bread and cakes.",
    "What does a compiler do?",
    "Write a short, friendly reminder to drink water during the day.",
    "Name three animals that live in the ocean.",
    "How do I boil an egg so the yolk stays soft?",
    "Tell me a fun fact about the Moon.",
]
MAX_NEW_TOKENS = [12, 24, 48, 64]  # cycled over the questions: mixed output lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--max-running-requests", type=int, default=8)
    parser.add_argument("--max-prefill-tokens", type=int, default=256)
    parser.add_argument("--pool-size", type=int, default=None, help="KV slots (default: the engine's default)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--new-token-ratio", type=float, default=0.5)
    parser.add_argument("--trace", action="store_true", help="print one line per scheduler step")
    args = parser.parse_args()

    path, device, model, tokenizer = load_from_args(args)
    engine = Engine(
        model,
        tokenizer,
        pool_size=args.pool_size,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        new_token_ratio=args.new_token_ratio,
        trace=args.trace,
    )
    params = [
        SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS[i % len(MAX_NEW_TOKENS)])
        for i in range(len(QUESTIONS))
    ]
    # Warm-up on a throwaway engine: the first passes pay for lazy setup in torch.
    Engine(model, tokenizer, pool_size=256).generate(QUESTIONS[:1], SamplingParams(max_new_tokens=2))

    print(f"model: {path}   device: {describe(device)}   attention: {engine.runner.attention_backend_name}")
    print(
        f"pool: {engine.runner.allocator.size} KV slots (page size {args.page_size}); up to "
        f"{args.max_running_requests} "
        f"requests at once, {args.max_prefill_tokens} prompt tokens admitted per step; {len(QUESTIONS)} requests\n"
    )
    start = time.perf_counter()
    outputs = engine.generate(QUESTIONS, params)
    elapsed = time.perf_counter() - start

    if args.trace:
        print()
    for i, (question, out) in enumerate(zip(QUESTIONS, outputs)):
        answer = " ".join(out.text.split())
        print(
            f"[{i:2d}] {question}\n     -> {answer[:110]!r}{'...' if len(answer) > 110 else ''}\n"
            f"     {out.prompt_tokens} prompt + {out.output_tokens} output tokens, {out.finish_reason}, "
            f"ttft {1000 * out.ttft:.0f} ms, latency {1000 * out.latency:.0f} ms"
        )
    stats = engine.scheduler.stats
    total = sum(out.output_tokens for out in outputs)
    print(f"\n{total} output tokens in {elapsed:.2f} s = {total / elapsed:.1f} tokens/s on {describe(device)}")
    print(
        f"{stats.steps} steps (one forward pass each); peak running batch size {stats.peak_running}; "
        f"{stats.num_retractions} retractions; prefill {stats.prefill_tokens} tokens, decode {stats.decode_tokens} "
        "tokens"
    )
    engine.scheduler.check_invariants()
    print(f"after the run: {engine.runner.allocator.available_size()}/{engine.runner.allocator.size} KV slots free")


if __name__ == "__main__":
    main()
