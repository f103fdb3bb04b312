"""Stage 7 milestone: a very long prompt arrives while others are streaming, unchunked vs chunked.

Four chat requests are decoding when a long prompt (a document to summarise) arrives. Without
chunking, the step that prefills it computes the whole document, and the four streams stall for
that long; with chunked prefill the document is read a chunk per step beside their decodes. For
each chunk budget this prints the running requests' worst and typical inter-token latency, the
long prompt's time to first token, and checks that the tokens are the same.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from s00_foundation.device import describe
from s00_foundation.milestone import add_model_args, load_from_args
from s00_foundation.tokenizer import Tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.__main__ import QUESTIONS

from .engine import Engine

PARAGRAPH = (
    "Section {n}. The harbour of the town was rebuilt after the storm of the previous winter. "
    "Fishermen, shop owners and the council met every week to decide what should come first: the "
    "sea wall, the market hall or the small library by the pier. In the end they agreed to repair "
    "the sea wall before anything else, because without it no other building would be safe. "
)


def long_document(tokenizer: Tokenizer, tokens: int) -> list[dict]:
    """A chat asking to summarise a document of about ``tokens`` tokens (numbered sections)."""
    text, n = "", 1
    while len(tokenizer.encode_prompt([{"role": "user", "content": text}])) < tokens:
        text += PARAGRAPH.format(n=n)
        n += 1
    return [{"role": "user", "content": text + "\nSummarise the document above in one sentence."}]


@dataclass
class Timeline:
    """What one run recorded: every step's end time and kind, every request's token times."""

    step_ends: list[float] = field(default_factory=list)
    step_prefill_tokens: list[int] = field(default_factory=list)
    token_times: dict = field(default_factory=dict)  # rid -> [time of each token]
    long_arrival: float = 0.0
    outputs: dict = field(default_factory=dict)  # rid -> output ids

    def itl(self, rids) -> list[float]:
        """Inter-token latencies (seconds) of the given requests."""
        return [b - a for rid in rids for a, b in zip(self.token_times[rid], self.token_times[rid][1:])]

    def ttft(self, rid) -> float:
        return self.token_times[rid][0] - self.long_arrival


def long_prompt_arrives(
    engine: Engine, streams, long_prompt, stream_params, long_params, arrive_after: int
) -> Timeline:
    """Run ``streams`` (rids "s0", "s1", ...); after ``arrive_after`` steps the long prompt (rid
    "long") arrives. Returns the timeline, times in seconds from the start."""
    timeline, start = Timeline(), time.perf_counter()
    for i, prompt in enumerate(streams):
        engine.add_request(prompt, stream_params, rid=f"s{i}")
    steps = 0
    with torch.inference_mode():
        while engine.has_work:
            if steps == arrive_after:
                timeline.long_arrival = time.perf_counter() - start
                engine.add_request(long_prompt, long_params, rid="long")
            prefill_before = engine.scheduler.stats.prefill_tokens
            outputs = engine.step()
            now = time.perf_counter() - start
            steps += 1
            timeline.step_ends.append(now)
            timeline.step_prefill_tokens.append(engine.scheduler.stats.prefill_tokens - prefill_before)
            for out in outputs:
                timeline.token_times.setdefault(out.rid, []).extend([now] * len(out.new_token_ids))
                timeline.outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    return timeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--long-tokens", type=int, default=1500, help="length of the long prompt")
    parser.add_argument(
        "--budgets", default="none,512,128,32", help="chunked_prefill_size values to compare ('none': no chunking)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens each streaming request generates")
    args = parser.parse_args()

    path, device, model, tokenizer = load_from_args(args)
    streams = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    document = long_document(tokenizer, args.long_tokens)
    stream_params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_new_tokens=8)
    budgets = [None if b.strip().lower() == "none" else int(b) for b in args.budgets.split(",")]
    Engine(model, tokenizer, pool_size=512).generate(streams[:1], SamplingParams(max_new_tokens=2))  # warm-up

    print(f"model: {path}   device: {describe(device)}")
    print(
        f"4 requests streaming {args.max_new_tokens} tokens each; after 5 steps a "
        f"{len(tokenizer.encode_prompt(document))}-token prompt arrives\n"
    )
    print(
        f"{'chunked_prefill_size':>20s} {'streams: worst ITL':>19s} {'median ITL':>11s} {'long prompt TTFT':>17s} "
        f"{'steps':>6s}"
    )
    reference = None
    for budget in budgets:
        engine = Engine(model, tokenizer, chunked_prefill_size=budget)
        timeline = long_prompt_arrives(engine, streams, document, stream_params, long_params, arrive_after=5)
        itl = timeline.itl([f"s{i}" for i in range(len(streams))])
        print(
            f"{str(budget):>20s} {1000 * max(itl):>16.0f} ms {1000 * statistics.median(itl):>8.0f} ms "
            f"{1000 * timeline.ttft('long'):>14.0f} ms {len(timeline.step_ends):>6d}"
        )
        reference = reference or timeline.outputs
        assert timeline.outputs == reference, f"chunked_prefill_size={budget} changed the tokens"
        engine.scheduler.check_invariants()
    print("\nidentical tokens for every budget: yes")
    print(
        "A smaller budget caps how long the streams stall (worst ITL) at the price of the long prompt's "
        "TTFT (more, smaller passes)."
    )


if __name__ == "__main__":
    main()
