"""Offline throughput: one stage's engine vs Hugging Face ``transformers`` on the same requests.

Both get the same random prompts (token ids, seeded), generate exactly ``--output-len``
tokens each (EOS ignored) greedily, and are timed after a warm-up run. ``transformers`` runs
the requests as one static batch, left-padded to the longest prompt (how its ``generate``
batches). Throughput = generated tokens / wall time. The numbers are printed, never asserted:
they depend on the machine (its device, its load) as much as on the code. Stage 8 captures each
CUDA graph when it first meets its bucket, inside the timed run: the capture time is printed
apart, with the throughput without it (a server pays it once, at start-up).

    python tools/benchmark_offline.py --stage 3 --num-requests 8 --input-len 64 --output-len 64
    python tools/benchmark_offline.py --stage 4 --model Qwen/Qwen3-0.6B --num-requests 32
    python tools/benchmark_offline.py --stage 5      # the field's usual workload: see benchmark_continuous

ENGINE_IMPL=stages benchmarks your own code instead of the reference (see impl_switch.py).
Later stages add their engine to ENGINES below.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

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


class EngineRun(NamedTuple):
    """What an engine run gives back: its outputs, and (stage 8) the CUDA graphs it captured on the
    way and the seconds that took, a one-time cost a server pays at start-up."""

    outputs: Prompts
    graphs: int = 0
    capture_s: float = 0.0


def run_stage3(model, tokenizer, prompts: Prompts, output_len: int, args) -> EngineRun:
    from s03_kv_cache.engine import generate

    params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    return EngineRun([out.output_ids for out in generate(model, tokenizer, prompts, params)])


def run_stage4(model, tokenizer, prompts: Prompts, output_len: int, args) -> EngineRun:
    from s02_request_and_sampling.engine import make_reqs
    from s04_paged_kv_pool.engine import StaticBatchEngine, slots_needed

    params = SamplingParams(temperature=0, max_new_tokens=output_len, ignore_eos=True)
    reqs = make_reqs(tokenizer, prompts, params)
    engine = StaticBatchEngine(model, pool_size=slots_needed(reqs, args.page_size), page_size=args.page_size,
                               max_running_requests=len(reqs), max_context_len=max(len(p) for p in prompts) + output_len)
    engine.run(reqs)
    return EngineRun([req.output_ids for req in reqs])


def run_continuous(engine_class, model, tokenizer, prompts: Prompts, output_len: int | list[int], args, **knobs) -> EngineRun:
    """Stage 5's engine or a later one (``engine_class``), with ``knobs`` of its own."""
    lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lens]
    # By default the pool holds every request at its longest, as stage 4's does: --pool-size smaller forces retractions.
    from s04_paged_kv_pool.allocator import pages_for

    p = args.page_size
    pool_size = args.pool_size or sum(pages_for(len(ids) + n - 1, p) * p for ids, n in zip(prompts, lens))
    engine = engine_class(model, tokenizer, pool_size=pool_size, page_size=p,
                          max_running_requests=args.max_running_requests or len(prompts),
                          max_prefill_tokens=args.max_prefill_tokens, **knobs)
    outputs = [out.output_ids for out in engine.generate(prompts, params)]
    graphs = getattr(engine.runner, "cuda_graph_runner", None)  # stage 8 on
    if graphs is None:
        return EngineRun(outputs)
    return EngineRun(outputs, len(graphs.graphs), graphs.capture_seconds)


def run_stage5(model, tokenizer, prompts: Prompts, output_len: int | list[int], args) -> EngineRun:
    from s05_continuous_batching.engine import Engine

    return run_continuous(Engine, model, tokenizer, prompts, output_len, args)


def run_stage7(model, tokenizer, prompts: Prompts, output_len: int | list[int], args) -> EngineRun:
    from s07_chunked_prefill.engine import Engine

    return run_continuous(Engine, model, tokenizer, prompts, output_len, args, chunked_prefill_size=args.chunked_prefill_size)


def run_stage8(model, tokenizer, prompts: Prompts, output_len: int | list[int], args) -> EngineRun:
    from s08_cuda_graph.engine import Engine

    # Graphs for every decode batch size the run can have (SGLang captures up to 256 and more on big GPUs).
    return run_continuous(Engine, model, tokenizer, prompts, output_len, args,
                          chunked_prefill_size=args.chunked_prefill_size,
                          cuda_graph_max_bs=args.max_running_requests or len(prompts))


ENGINES: dict[int, tuple[str, Callable]] = {
    3: ("stage 3: per-request KV caches, all requests in one ragged pass per step", run_stage3),
    4: ("stage 4: static batch out of one paged KV pool", run_stage4),
    5: ("stage 5: continuous batching (scheduler, mixed prefill + decode passes, retraction)", run_stage5),
    7: ("stage 7: stage 6's radix-cache engine with chunked prefill", run_stage7),
    8: ("stage 8: stage 7's engine with decode passes replayed from CUDA graphs (on a CPU: no graphs, as stage 7)", run_stage8),
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


def continuous_workload(device: torch.device) -> dict:
    """Stage 5's default workload, the field's usual offline one (nano-vllm's benchmark): random
    prompts, input and output lengths uniform in 100..1024, 256 requests, EOS ignored; scaled down
    to 32 requests of 32..128 / 32..128 tokens on a CPU. Explicit flags override it."""
    if device.type == "cuda":
        return dict(num_requests=256, input_len=1024, output_len=1024, range_ratio=100 / 1024, output_range_ratio=100 / 1024)
    return dict(num_requests=32, input_len=128, output_len=128, range_ratio=0.25, output_range_ratio=0.25)


def run_transformers_static_batches(hf_model, prompts: Prompts, output_lens: list[int], pad_id: int, batch_size: int) -> Prompts:
    """``generate`` on ``batch_size`` requests at a time: each batch runs until its longest output."""
    outputs = []
    for start in range(0, len(prompts), batch_size):
        lens = output_lens[start : start + batch_size]
        batch = run_transformers(hf_model, prompts[start : start + batch_size], max(lens), pad_id)
        outputs += [ids[:n] for ids, n in zip(batch, lens)]
    return outputs


def run_transformers_continuous(hf_model, prompts: Prompts, output_lens: list[int], pad_id: int) -> Prompts:
    """transformers' own continuous batching (the manager behind ``generate_batch``), with each
    request's own max_new_tokens. The manager is kept between calls, so the timed run does not
    pay for its setup (the warm-up call does)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
    results = {}
    with hf_model.continuous_batching_context_manager(generation_config=config, persistent_manager=True) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, output_lens)]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("its generation thread stopped before every request finished")
    return [list(results[i].generated_tokens) for i in ids]


def random_prompts(vocab: int, lengths: list[int], generator: torch.Generator) -> Prompts:
    """Token-id prompts of the given lengths, ids from the middle of the vocabulary: ordinary
    tokens, no special ones."""
    return [torch.randint(vocab // 10, vocab // 2, (k,), generator=generator).tolist() for k in lengths]


def time_engine(engine: Callable, model, tokenizer, prompts: Prompts, output_len, args, device) -> tuple[EngineRun, float]:
    """The engine's outputs on ``prompts`` and their wall time, after a warm-up run (allocator,
    kernels, lazy initialisation)."""
    engine(model, tokenizer, prompts[:1], 2, args)
    return timed(lambda: engine(model, tokenizer, prompts, output_len, args), device)


def load_transformers(path, dtype, device, tokenizer, warmup_prompt: list[int]):
    """(transformers' model of the same weights, its pad id), warmed up on one prompt."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    pad_id = tokenizer.hf.pad_token_id if tokenizer.hf.pad_token_id is not None else 0
    run_transformers(hf_model, [warmup_prompt], 2, pad_id)
    return hf_model, pad_id


def benchmark_continuous(args, model, tokenizer, path, device, dtype) -> None:
    """Stage 5: requests of mixed input and output lengths, this engine vs transformers generate
    (static batches) vs transformers' continuous batching, on the same requests."""
    generator = torch.Generator().manual_seed(args.seed)
    n = args.num_requests

    def uniform(ratio: float, high: int) -> list[int]:
        return torch.randint(max(1, int(ratio * high)), high + 1, (n,), generator=generator).tolist()

    input_lens, output_lens = uniform(args.range_ratio, args.input_len), uniform(args.output_range_ratio, args.output_len)
    prompts = random_prompts(model.config.vocab_size, input_lens, generator)
    total = sum(output_lens)
    name, engine = ENGINES[args.stage]
    print(f"model: {path}  dtype: {str(dtype).removeprefix('torch.')}  device: {describe(device)}")
    print(f"{SWITCH.describe()}")
    print(f"{n} requests, prompts of {min(input_lens)}..{max(input_lens)} tokens, outputs of {min(output_lens)}..{max(output_lens)} "
          f"tokens ({total} in all, EOS ignored), greedy; throughput = output tokens / wall time")

    run, ours_s = time_engine(engine, model, tokenizer, prompts, output_lens, args, device)
    ours = run.outputs
    print(f"\n{name}")
    print(f"  engine:                            {total:7d} tokens in {ours_s:8.2f} s = {total / ours_s:9.1f} tokens/s")
    # Graphs are captured when a bucket is first met, inside the timed run; a server captures
    # once, at start-up, so the figure without that time is the one a long-running engine sees.
    steady_s = ours_s - run.capture_s
    if run.graphs:
        print(f"  of which CUDA graph capture:       {run.graphs} graphs in {run.capture_s:.2f} s; without it "
              f"{total / steady_s:.1f} tokens/s")

    def ratio(theirs_s: float) -> str:
        without = f" ({theirs_s / steady_s:.2f}x without the graph capture)" if run.graphs else ""
        return f"{theirs_s / ours_s:.2f}x{without} on {describe(device)}"

    if args.skip_transformers:
        return

    hf_model, pad_id = load_transformers(path, dtype, device, tokenizer, prompts[0])
    batch = args.hf_batch_size or n
    static, static_s = timed(lambda: run_transformers_static_batches(hf_model, prompts, output_lens, pad_id, batch), device)
    print(f"  transformers generate, static:     {total:7d} tokens in {static_s:8.2f} s = {total / static_s:9.1f} tokens/s "
          f"(batches of {batch}, left-padded, each runs to its longest output)")
    try:
        run_transformers_continuous(hf_model, prompts[:1], [2], pad_id)  # warm-up, and the manager's setup
        cb, cb_s = timed(lambda: run_transformers_continuous(hf_model, prompts, output_lens, pad_id), device)
        print(f"  transformers continuous batching:  {total:7d} tokens in {cb_s:8.2f} s = {total / cb_s:9.1f} tokens/s "
              "(its ContinuousBatchingManager, each request with its own max_new_tokens)")
    except Exception as error:  # an older transformers, or a device its manager does not support
        cb = None
        print(f"  transformers continuous batching:  did not run here: {type(error).__name__}: {error}")
    finally:
        if hasattr(hf_model, "destroy_cached_continuous_batching_manager"):
            hf_model.destroy_cached_continuous_batching_manager()
    print(f"  engine / transformers static:      {ratio(static_s)}")
    if cb is not None:
        print(f"  engine / transformers continuous:  {ratio(cb_s)}")
    for what, theirs in (("static", static), ("continuous", cb)):
        if theirs is not None:
            same = sum(a == b for a, b in zip(ours, theirs))
            print(f"  greedy outputs identical to transformers {what} for {same}/{n} requests "
                  "(informative: padding and reduced precision may shift near-ties)")


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
    stage5 = parser.add_argument_group("stage 5 (its defaults: see continuous_workload)")
    stage5.add_argument("--output-range-ratio", type=float, default=1.0,
                        help="output lengths are uniform in [ratio * output-len, output-len]")
    stage5.add_argument("--max-running-requests", type=int, default=None, help="default: all requests")
    stage5.add_argument("--max-prefill-tokens", type=int, default=4096)
    stage5.add_argument("--chunked-prefill-size", type=int, default=512, help="stage 7 on: prompt tokens per step")
    stage5.add_argument("--pool-size", type=int, default=None, help="KV slots (default: all requests at their longest)")
    stage5.add_argument("--hf-batch-size", type=int, default=None, help="transformers static batch size (default: all requests)")
    args = parser.parse_args()
    if args.stage >= 5:  # the field's usual workload, scaled to the device; explicit flags still win
        parser.set_defaults(**continuous_workload(torch.device(args.device) if args.device else default_device()))
        args = parser.parse_args()
    if not 0 < args.range_ratio <= 1:
        parser.error("--range-ratio must be in (0, 1]")
    if not 0 < args.output_range_ratio <= 1:
        parser.error("--output-range-ratio must be in (0, 1]")

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model or default_model_path())
    device = torch.device(args.device) if args.device else default_device()
    dtype = default_dtype(device)
    model, tokenizer = load_model(path, device=device, dtype=dtype), Tokenizer(path)
    if args.stage >= 5:
        return benchmark_continuous(args, model, tokenizer, path, device, dtype)

    generator = torch.Generator().manual_seed(args.seed)
    low = max(1, int(args.range_ratio * args.input_len))
    lengths = torch.randint(low, args.input_len + 1, (args.num_requests,), generator=generator).tolist()
    prompts = random_prompts(model.config.vocab_size, lengths, generator)
    total = args.num_requests * args.output_len

    name, engine = ENGINES[args.stage]
    print(f"model: {path}  dtype: {str(dtype).removeprefix('torch.')}  device: {describe(device)}")
    print(f"{SWITCH.describe()}")
    print(f"{args.num_requests} requests, prompts of {min(lengths)}..{max(lengths)} tokens, {args.output_len} new tokens each "
          f"(EOS ignored), greedy")

    run, ours_s = time_engine(engine, model, tokenizer, prompts, args.output_len, args, device)
    ours = run.outputs
    print(f"\n{name}")
    print(f"  engine:       {total:6d} tokens in {ours_s:8.2f} s = {total / ours_s:9.1f} tokens/s")
    if args.skip_transformers:
        return

    hf_model, pad_id = load_transformers(path, dtype, device, tokenizer, prompts[0])
    theirs, theirs_s = timed(lambda: run_transformers(hf_model, prompts, args.output_len, pad_id), device)
    print(f"  transformers: {total:6d} tokens in {theirs_s:8.2f} s = {total / theirs_s:9.1f} tokens/s "
          f"(static batch, left padding to {max(lengths)})")
    print(f"  engine / transformers throughput: {theirs_s / ours_s:.2f}x on {describe(device)}")
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"  greedy outputs identical for {same}/{len(prompts)} requests "
          "(informative: padding and reduced precision may shift near-ties)")


if __name__ == "__main__":
    main()
