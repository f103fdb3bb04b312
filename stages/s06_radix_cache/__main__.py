"""Stage 6 milestone: many chat requests sharing a long system prompt, without and with the radix cache.

The first request arrives alone (it meets an empty cache), the rest follow. Prints, side by side,
the prefill tokens computed, the tokens found cached, mean time to first token and throughput;
then the radix tree drawn mid-run (running requests lock the system prompt's node) and after the
run. Both engines must produce the same tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from s00_foundation.device import describe
from s00_foundation.milestone import add_model_args, load_from_args
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.__main__ import QUESTIONS

from .engine import Engine

SYSTEM_PROMPT = (
    "You are Pip, the helpful assistant of a small public library in a seaside town. You answer "
    "questions from visitors of every age. Be friendly, precise and brief: two or three sentences "
    "are usually enough. If a question is about something you do not know, say so honestly and "
    "suggest where the visitor could look it up, for example in the reference section on the first "
    "floor or with the librarian at the front desk. Never make up facts, dates or numbers. Avoid "
    "jargon; when a technical word is needed, explain it in plain words. Keep a calm, warm tone, "
    "and end with a short offer to help further when it feels natural."
)


def run(engine: Engine, prompts, params, draw_mid_run: bool):
    """The first request alone, then the rest together (step by step); returns (reqs, seconds, drawing)."""
    start, drawing = time.perf_counter(), None
    reqs = [engine.add_request(prompts[0], params)]
    with torch.inference_mode():
        while engine.has_work:
            engine.step()
        reqs += [engine.add_request(p, params) for p in prompts[1:]]
        while engine.has_work:
            engine.step()
            if draw_mid_run and drawing is None and engine.tree_cache is not None:
                drawing = engine.tree_cache.pretty(engine.tokenizer)
    return reqs, time.perf_counter() - start, drawing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-running-requests", type=int, default=8)
    parser.add_argument("--pool-size", type=int, default=None, help="KV slots (default: the engine's default)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"])
    args = parser.parse_args()

    path, device, model, tokenizer = load_from_args(args)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_requests)]
    prompts = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    knobs = dict(
        pool_size=args.pool_size,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        schedule_policy=args.schedule_policy,
    )
    # Warm-up on a throwaway engine: the first passes pay for lazy setup in torch.
    Engine(model, tokenizer, pool_size=512).generate(prompts[:1], SamplingParams(max_new_tokens=2))

    system_len = len(tokenizer.encode_prompt([{"role": "system", "content": SYSTEM_PROMPT}]))
    print(f"model: {path}   device: {describe(device)}")
    print(
        f"{len(prompts)} requests sharing a system prompt of about {system_len} tokens; "
        f"{args.max_new_tokens} new tokens each; the first arrives alone\n"
    )
    results, drawing = {}, None
    for enable in (False, True):
        engine = Engine(model, tokenizer, enable_radix_cache=enable, **knobs)
        reqs, elapsed, mid = run(engine, prompts, params, draw_mid_run=enable)
        results[enable] = (engine, reqs, elapsed)
        drawing = mid or drawing

    rows = []
    for enable in (False, True):
        engine, reqs, elapsed = results[enable]
        stats = engine.scheduler.stats
        ttft = sum(r.time_stats.first_token - r.time_stats.arrival for r in reqs) / len(reqs)
        out = sum(len(r.output_ids) for r in reqs)
        rows.append(
            (
                f"{'with' if enable else 'without'} radix cache",
                stats.prefill_tokens,
                stats.cached_tokens,
                1000 * ttft,
                out / elapsed,
                elapsed,
            )
        )
    print(
        f"{'':22s} {'prefill computed':>16s} {'found cached':>13s} {'mean TTFT':>10s} {'throughput':>13s} {'total':>8s}"
    )
    for name, prefill, cached, ttft, tput, elapsed in rows:
        print(
            f"{name:22s} {prefill:>9d} tokens {cached:>6d} tokens {ttft:>7.0f} ms {tput:>7.1f} tok/s {elapsed:>6.2f} s"
        )
    same = all(a.output_ids == b.output_ids for a, b in zip(results[False][1], results[True][1]))
    print(f"\nidentical tokens with and without the cache: {'yes' if same else 'NO'}")

    engine = results[True][0]
    print("\nthe radix tree one step after the other requests arrived (running requests lock what they read):")
    print(drawing)
    print("\nthe radix tree after the run (nothing locked: every node is evictable):")
    print(engine.tree_cache.pretty(engine.tokenizer))
    engine.scheduler.check_invariants()
    engine.tree_cache.check()


if __name__ == "__main__":
    main()
