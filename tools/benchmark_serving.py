"""Serving benchmark: requests sent at a given rate to the running server (stage 9), measured as
a client sees them, next to the offline engine on the same requests.

The workload is the field's "random" one (SGLang's bench_serving, nano-vllm): prompts of random
token ids, input and output lengths uniform in [range_ratio * len, len], EOS ignored, greedy,
sent to /v1/completions as token ids with streaming on. Arrivals are a Poisson process of the
given rate (seeded); "inf" sends everything at once. Per request it records:

    TTFT  time to first token: from sending to the first text piece
    ITL   inter-token latency: between consecutive text pieces
    E2E   end-to-end latency: from sending to the last piece

and prints p50 / p90 / p99 of each, request throughput and output-token throughput (completion
tokens / wall time from the first send to the last answer), next to the offline engine's
throughput on the same requests (run in this process before the server starts, so they never
compete for the machine). The radix cache is off on both sides: the random prompts share nothing,
and each rate reuses the same prompts, which a cache would otherwise find from the previous rate.
Numbers are printed (and written with --json), never asserted.

    python tools/benchmark_serving.py --rates 1,2,4,inf
    python tools/benchmark_serving.py --model Qwen/Qwen3-0.6B --num-requests 256 --input-len 1024 \\
        --output-len 1024 --rates 4,8,16,inf
    python tools/benchmark_serving.py --url http://127.0.0.1:30000 --rates 2    # a server you started (no offline run)

ENGINE_IMPL=stages benchmarks your own code instead of the reference (see impl_switch.py).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import impl_switch  # noqa: E402

SWITCH = impl_switch.install()

import openai  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from s00_foundation.device import default_device, describe  # noqa: E402
from s00_foundation.paths import default_model_path  # noqa: E402
from s02_request_and_sampling.sampling_params import SamplingParams  # noqa: E402

PERCENTILES = (50, 90, 99)


@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool
    sent: float = 0.0
    first: float | None = None  # time of the first text piece
    pieces: list[float] = field(default_factory=list)  # times of every text piece
    end: float = 0.0
    completion_tokens: int = 0
    error: str = ""


def make_workload(
    vocab_size: int, num_requests: int, input_len: int, output_len: int, range_ratio: float, seed: int, special_ids=()
) -> list[Request]:
    """Random token-id prompts (special tokens avoided), lengths uniform in [ratio * len, len]."""
    rng = random.Random(seed)
    special = set(special_ids)
    ordinary = [t for t in range(vocab_size) if t not in special]
    return [
        Request(
            [rng.choice(ordinary) for _ in range(rng.randint(max(1, int(range_ratio * input_len)), input_len))],
            rng.randint(max(1, int(range_ratio * output_len)), output_len),
        )
        for _ in range(num_requests)
    ]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{p}": math.nan for p in PERCENTILES}
    ordered = sorted(values)
    return {f"p{p}": ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)] for p in PERCENTILES}


async def send_one(client: openai.AsyncOpenAI, model: str, request: Request) -> Result:
    result = Result(ok=False, sent=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model,
            prompt=request.prompt,
            max_tokens=request.output_len,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                result.first = result.first or now
                result.pieces.append(now)
        result.end, result.ok = time.perf_counter(), True
    except openai.OpenAIError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run_rate_async(
    base_url: str, model: str, requests: list[Request], rate: float, seed: int, progress: bool
) -> dict:
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=3600)
    try:
        bar = tqdm(total=len(requests), desc=f"rate {rate:g} req/s", unit="req", disable=not progress, leave=False)
        tasks = []

        async def tracked(request):
            result = await send_one(client, model, request)
            bar.update(1)
            return result

        start = time.perf_counter()
        for i, request in enumerate(requests):
            if i and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals: exponential gaps
            tasks.append(asyncio.create_task(tracked(request)))
        results = await asyncio.gather(*tasks)
        bar.close()
    finally:
        await client.close()
    return summarize(results, rate, time.perf_counter() - start)


def summarize(results: list[Result], rate: float, duration: float) -> dict:
    done = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in done)
    itl = [b - a for r in done for a, b in zip(r.pieces, r.pieces[1:])]
    return {
        "rate": rate,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / duration,
        "request_throughput": len(done) / duration,
        "ttft_ms": {k: 1000 * v for k, v in percentiles([r.first - r.sent for r in done if r.first]).items()},
        "itl_ms": {k: 1000 * v for k, v in percentiles(itl).items()},
        "e2e_ms": {k: 1000 * v for k, v in percentiles([r.end - r.sent for r in done]).items()},
    }


def run_rate(
    base_url: str, model: str, requests: list[Request], rate: float, seed: int = 0, progress: bool = True
) -> dict:
    """Send ``requests`` to the server at ``rate`` requests/s (inf: all at once); the summary."""
    job = run_rate_async(base_url, model, requests, rate, seed, progress)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(job)
    # Called from a running event loop (a notebook kernel): run on a loop of its own, in a thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, job).result()


def offline_throughput(model_path: str, requests: list[Request], knobs: dict) -> dict:
    """The newest engine (the one the server runs), in this process, on the same requests:
    output tokens / wall time of one generate() call, after a warm-up on other prompts."""
    from s09_zmq_serving.scheduler_process import build_engine

    engine = build_engine(model_path, knobs)
    params = [SamplingParams(temperature=0, max_new_tokens=r.output_len, ignore_eos=True) for r in requests]
    warm = [list(reversed(r.prompt)) for r in requests[:2]]
    engine.generate(warm, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outputs = engine.generate([r.prompt for r in requests], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.output_ids) for o in outputs)
    return {"duration_s": elapsed, "output_tokens": tokens, "throughput_tok_s": tokens / elapsed}


def print_table(rows: list[dict], offline: dict | None) -> None:
    print(
        f"{'rate (req/s)':>12} {'done':>5} {'TTFT p50/p90/p99 (ms)':>24} {'ITL p50/p90/p99 (ms)':>22} "
        f"{'E2E p50/p90/p99 (ms)':>24} {'req/s':>6} {'tok/s':>7}" + ("  vs offline" if offline else "")
    )
    for row in rows:

        def three(m, row=row):
            return "/".join(f"{row[m][f'p{p}']:.0f}" for p in PERCENTILES)

        ratio = f"  {row['throughput_tok_s'] / offline['throughput_tok_s']:9.2f}x" if offline else ""
        print(
            f"{row['rate']:>12g} {row['completed']:>5d} {three('ttft_ms'):>24} {three('itl_ms'):>22} "
            f"{three('e2e_ms'):>24} "
            f"{row['request_throughput']:>6.2f} {row['throughput_tok_s']:>7.1f}{ratio}"
        )
        if row["failed"]:
            print(f"{'':12} {row['failed']} request(s) failed: {row['errors']}")
    if offline:
        print(
            f"{'offline':>12} {'':5} {'(engine.generate on the same requests, all at once)':>72} {'':6} "
            f"{offline['throughput_tok_s']:>7.1f}"
        )


def workload_defaults(device: torch.device) -> dict:
    """A workload that takes about a minute on a 2-core CPU; bigger on a GPU."""
    if device.type == "cuda":
        return dict(num_requests=256, input_len=512, output_len=256, rates="4,16,64,inf")
    return dict(num_requests=24, input_len=64, output_len=32, rates="1,2,4,inf")


def main() -> int:
    device = default_device()
    defaults = workload_defaults(device)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--url", default=None, help="benchmark this running server instead of starting one (no offline run)"
    )
    parser.add_argument("--num-requests", type=int, default=defaults["num_requests"])
    parser.add_argument("--input-len", type=int, default=defaults["input_len"])
    parser.add_argument("--output-len", type=int, default=defaults["output_len"])
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument(
        "--rates", default=defaults["rates"], help="comma-separated request rates (req/s); inf = all at once"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-args",
        default="",
        help="more flags for the server (the offline run gets the same engine knobs), e.g. '--max-running-requests 32'",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    from s00_foundation.tokenizer import Tokenizer
    from s09_zmq_serving.server_args import add_cli_args, from_cli_args
    from s09_zmq_serving.server_process import ServerProcess

    model_path = str(args.model or default_model_path())
    tokenizer = Tokenizer(model_path)
    special = tokenizer.hf.all_special_ids
    requests = make_workload(
        tokenizer.vocab_size, args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed, special
    )
    print(f"model: {model_path}   device: {describe(device)}   torch threads: {torch.get_num_threads()}")
    print(
        f"{len(requests)} requests, input {args.range_ratio:g}x..1x of {args.input_len} tokens, output "
        f"{args.range_ratio:g}x..1x of {args.output_len} tokens (EOS ignored, greedy); rates {rates}\n"
    )
    server_flags = ["--model", model_path, "--disable-radix-cache", *args.server_args.split()]
    offline = None
    if args.url is None:
        # The offline engine gets exactly the server's engine knobs, parsed by the server's own parser.
        server_parser = argparse.ArgumentParser()
        add_cli_args(server_parser)
        knobs = from_cli_args(server_parser.parse_args(server_flags)).engine_knobs
        print("offline engine on the same requests ...", flush=True)
        offline = offline_throughput(model_path, requests, knobs)
        print(
            f"offline: {offline['output_tokens']} tokens in {offline['duration_s']:.2f} s = "
            f"{offline['throughput_tok_s']:.1f} tok/s\n",
            flush=True,
        )
    rows = []
    server = None if args.url else ServerProcess(server_flags)
    try:
        if server is not None:
            server.wait_ready()
        base_url = args.url or server.base_url
        model = openai.OpenAI(base_url=base_url + "/v1", api_key="none").models.list().data[0].id
        run_rate(base_url, model, requests[:2], math.inf, progress=False)  # warm-up
        for rate in rates:
            rows.append(run_rate(base_url, model, requests, rate, args.seed))
    finally:
        if server is not None:
            server.stop()
    print()
    print_table(rows, offline)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": model_path,
                    "device": describe(device),
                    "workload": vars(args) | {"json": str(args.json)},
                    "offline": offline,
                    "rates": rows,
                },
                indent=1,
                default=str,
            )
        )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
