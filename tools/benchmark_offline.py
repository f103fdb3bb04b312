"""Offline throughput: one stage's engine vs Hugging Face ``transformers`` on the same requests.

Both get the same random prompts (token ids, seeded), generate exactly ``--output-len``
tokens each (EOS ignored) greedily, and are timed after a warm-up run. ``transformers`` runs
the requests as one static batch, left-padded to the longest prompt (how its ``generate``
batches). Throughput = generated tokens / wall time. The numbers are printed, never asserted:
they depend on the machine (its device, its load) as much as on the code.

    python tools/benchmark_offline.py --stage 3 --num-requests 8 --input-len 64 --output-len 64
    python tools/benchmark_offline.py --stage 4 --model Qwen/Qwen3-0.6B --num-requests 32

ENGINE_IMPL=stages benchmarks your own code instead of the reference (see impl_switch.py).
Later stages add their engine to ENGINES below.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import impl_switch  # noqa: E402

SWITCH = impl_switch.install()

import torch  # noqa: E402

from s00_foundation.device import default_device, default_dtype, describe  # noqa: E402
from s00_foundation.loader import load_model, resolve_model_path  # noqa: E402
from s00_foundation.paths import default_model_path  # noqa: E402
from s00_foundation.tokenizer import Tokenizer  # noqa: E402
from s02_request_and_sampling.sampling_params import SamplingParams  # noqa: E402

Prompts = list[list[int]]


def run_stage3(model, tokenizer, prompts: Prompts, output_len: int, args) -> Prompts:
    from s03_kv_cache.engine import generate

    params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    return [out.output_ids for out in generate(model, tokenizer, prompts, params)]


def run_stage4(model, tokenizer, prompts: Prompts, output_len: int, args) -> Prompts:
    from s02_request_and_sampling.engine import make_reqs
    from s04_paged_kv_pool.engine import StaticBatchEngine, slots_needed

    params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    reqs = make_reqs(tokenizer, prompts, params)
    engine = StaticBatchEngine(model, pool_size=slots_needed(reqs, args.page_size), page_size=args.page_size,
                               max_running_requests=len(reqs), max_context_len=max(len(p) for p in prompts) + output_len)
    engine.run(reqs)
    return [req.output_ids for req in reqs]


ENGINES: dict[int, tuple[str, Callable]] = {
    3: ("stage 3: per-request KV caches, all requests in one ragged pass per step", run_stage3),
    4: ("stage 4: static batch out of one paged KV pool", run_stage4),
}


def run_transformers(hf_model, prompts: Prompts, output_len: int, pad_id: int) -> Prompts:
    width = max(len(p) for p in prompts)
    device = hf_model.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
            min_new_tokens=output_len, eos_token_id=[], pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


def timed(fn: Callable[[], Prompts], device: torch.device) -> tuple[Prompts, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, required=True, choices=sorted(ENGINES))
    parser.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request (the longest, with --range-ratio)")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request (EOS ignored)")
    parser.add_argument("--range-ratio", type=float, default=1.0,
                        help="prompt lengths are uniform in [ratio * input-len, input-len] (1.0: all equal)")
    parser.add_argument("--page-size", type=int, default=1, help="KV pool page size (stage 4 on)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--skip-transformers", action="store_true", help="time only the engine")
    args = parser.parse_args()
    if not 0 < args.range_ratio <= 1:
        parser.error("--range-ratio must be in (0, 1]")

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model or default_model_path())
    device = torch.device(args.device) if args.device else default_device()
    dtype = default_dtype(device)
    model, tokenizer = load_model(path, device=device, dtype=dtype), Tokenizer(path)

    generator = torch.Generator().manual_seed(args.seed)
    low = max(1, int(args.range_ratio * args.input_len))
    lengths = torch.randint(low, args.input_len + 1, (args.num_requests,), generator=generator).tolist()
    # Ids from the middle of the vocabulary: ordinary tokens, no special ones.
    vocab = model.config.vocab_size
    prompts = [torch.randint(vocab // 10, vocab // 2, (n,), generator=generator).tolist() for n in lengths]
    total = args.num_requests * args.output_len

    name, engine = ENGINES[args.stage]
    print(f"model: {path}  dtype: {str(dtype).removeprefix('torch.')}  device: {describe(device)}")
    print(f"{SWITCH.describe()}")
    print(f"{args.num_requests} requests, prompts of {min(lengths)}..{max(lengths)} tokens, {args.output_len} new tokens each "
          f"(EOS ignored), greedy")

    engine(model, tokenizer, prompts[:1], 2, args)  # warm-up: allocator, kernels, lazy init
    ours, ours_s = timed(lambda: engine(model, tokenizer, prompts, args.output_len, args), device)
    print(f"\n{name}")
    print(f"  engine:       {total:6d} tokens in {ours_s:8.2f} s = {total / ours_s:9.1f} tokens/s")
    if args.skip_transformers:
        return

    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    pad_id = tokenizer.hf.pad_token_id if tokenizer.hf.pad_token_id is not None else 0
    run_transformers(hf_model, prompts[:1], 2, pad_id)  # warm-up
    theirs, theirs_s = timed(lambda: run_transformers(hf_model, prompts, args.output_len, pad_id), device)
    print(f"  transformers: {total:6d} tokens in {theirs_s:8.2f} s = {total / theirs_s:9.1f} tokens/s "
          f"(static batch, left padding to {max(lengths)})")
    print(f"  engine / transformers throughput: {theirs_s / ours_s:.2f}x on {describe(device)}")
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"  greedy outputs identical for {same}/{len(prompts)} requests "
          "(informative: padding and reduced precision may shift near-ties)")


if __name__ == "__main__":
    main()
