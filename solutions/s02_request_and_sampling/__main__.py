"""Stage 2 milestone: one prompt, several sampled continuations, each reproducible from its seed,
how sure the model was of its greedy answer (its tokens' log-probabilities), and the same greedy
answer under a repetition penalty."""

from __future__ import annotations

import argparse
import math
import time

from s00_foundation.device import describe
from s00_foundation.milestone import add_model_args, load_from_args

from .engine import generate
from .sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_args(parser)
    parser.add_argument("--prompt", default="Write one sentence about a cat who learns to fly.")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-p", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repetition-penalty", type=float, default=1.3)
    args = parser.parse_args()

    path, device, model, tokenizer = load_from_args(args)

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            min_p=args.min_p,
            max_new_tokens=args.max_new_tokens,
            seed=seed,
        )

    # One batch: greedy, one request per seed, the first seed once more to show it repeats, and
    # greedy again with a repetition penalty.
    labels = ["greedy"] + [f"seed={s}" for s in args.seeds] + [f"seed={args.seeds[0]} again"]
    labels.append(f"greedy, repetition_penalty={args.repetition_penalty}")
    params = [SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, logprobs=0)]
    params += [sampled(s) for s in args.seeds] + [sampled(args.seeds[0])]
    params.append(
        SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, repetition_penalty=args.repetition_penalty)
    )

    generate(model, tokenizer, [args.prompt], SamplingParams(max_new_tokens=1))  # warm-up: kernels load, untimed
    start = time.perf_counter()
    outputs = generate(model, tokenizer, [args.prompt] * len(params), params)
    elapsed = time.perf_counter() - start

    print(f"model: {path}   device: {describe(device)}")
    print(f"prompt: {args.prompt!r}")
    print(f"sampling: temperature={args.temperature} top_p={args.top_p} min_p={args.min_p}\n")
    width = max(len(label) for label in labels)
    for label, out in zip(labels, outputs):
        print(f"{label:>{width}} [{out.finish_reason}]: {out.text!r}")
    same = outputs[-2].output_ids == outputs[1].output_ids
    print(
        f"\nseed={args.seeds[0]} twice -> {'identical' if same else 'DIFFERENT (a seed should reproduce its run!)'} "
        "continuations"
    )
    entries = outputs[0].logprobs or []
    if entries:
        least = min(entries, key=lambda entry: entry.logprob)
        print(
            f"greedy answer: log p = {sum(e.logprob for e in entries):.2f} over {len(entries)} tokens; the model was "
            f"least sure of {tokenizer.decode([least.token_id])!r} (p = {math.exp(least.logprob):.2f})"
        )
    prompt_ids, plain, penalised = tokenizer.encode_prompt(args.prompt), outputs[0], outputs[-1]
    print(
        f"answer tokens already seen in the prompt or answer: greedy {repeats(prompt_ids, plain.output_ids)} of "
        f"{plain.output_tokens}, with repetition_penalty={args.repetition_penalty} "
        f"{repeats(prompt_ids, penalised.output_ids)} of {penalised.output_tokens}"
    )
    total = sum(out.output_tokens for out in outputs)
    print(
        f"{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s "
        f"({len(outputs)} requests sampled as one batch; each forward still recomputes the whole sequence)"
    )


def repeats(prompt_ids: list[int], output_ids: list[int]) -> int:
    """How many output tokens already appeared in the prompt or earlier in the output."""
    seen, count = set(prompt_ids), 0
    for token in output_ids:
        count += token in seen
        seen.add(token)
    return count


if __name__ == "__main__":
    main()
