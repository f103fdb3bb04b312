"""The steps of tools/gpu_check.py, each run in a process of its own (see there).

A step is a list of checks; each check ends PASS, FAIL or SKIP with one line of detail and its
figures, and the result file is rewritten after every check, so a step killed at its timeout
still reports the checks it finished.

The models are random-weight ones of real shapes (s08 decode_latency.py): SmolLM2-135M's and
Qwen3-0.6B's on a GPU, four-layer stand-ins of the same families in the CPU rehearsal. Random
weights make near-uniform logits: greedy ties are common, so bfloat16 comparisons accept a
different token only where the eager logits of the two tokens are within rounding of each other.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import impl_switch  # noqa: E402

impl_switch.install()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from s00_foundation.attention import NoCacheBackend, causal_attention  # noqa: E402
from s00_foundation.device import avoid_cudnn_attention, describe, set_torch_threads  # noqa: E402
from s00_foundation.forward_batch import ForwardBatch  # noqa: E402
from s02_request_and_sampling.sampling_params import SamplingParams  # noqa: E402
from s04_paged_kv_pool.paged_backend import PagedAttentionBackend  # noqa: E402
from s08_cuda_graph.cuda_graph_runner import DUMMY_SLOT, capture_bs_buckets, kv_len_buckets  # noqa: E402
from s08_cuda_graph.decode_latency import (  # noqa: E402
    QWEN3_0_6B,
    SMALL_QWEN3,
    SMALL_SMOLLM2,
    SMOLLM2_135M,
    decode_step_latency,
    random_model,
    synchronize,
)
from s08_cuda_graph.engine import Engine  # noqa: E402
from s08_cuda_graph.model_runner import GraphModelRunner  # noqa: E402
from s10_overlap_scheduling.engine import OverlapEngine  # noqa: E402

READ_SLOTS = 16384  # K/V slots filled with random values that decodes read and never write


class Checks:
    """The checks of one step, written to the result file as they finish."""

    def __init__(self, result_file: Path, rehearsal: bool, quick: bool):
        self.result_file, self.rehearsal, self.quick = result_file, rehearsal, quick
        self.device = torch.device("cpu" if rehearsal else "cuda")
        self.done: list[dict] = []

    @contextmanager
    def check(self, name: str):
        """Run a check's body; it fills record["detail"] / ["data"] and may set ["status"]."""
        record: dict[str, Any] = {"check": name, "status": "PASS", "detail": "", "data": {}}
        start = time.perf_counter()
        print(f"--- {name}", flush=True)
        try:
            yield record
        except Exception as error:  # the check failed; the step goes on with the next one
            traceback.print_exc()
            record["status"], record["detail"] = "FAIL", f"{type(error).__name__}: {error}"[:600]
        record["seconds"] = round(time.perf_counter() - start, 2)
        print(f"    {record['status']} {record['detail']}", flush=True)
        self.done.append(record)
        self.result_file.write_text(json.dumps(self.done, indent=1))

    # what to run, by mode
    def shapes(self) -> list[tuple[str, dict]]:
        if self.quick:
            return [("qwen3-shape (small)", SMALL_QWEN3)]
        if self.rehearsal:
            return [("smollm2-shape (small)", SMALL_SMOLLM2), ("qwen3-shape (small)", SMALL_QWEN3)]
        return [("smollm2-135m-shape", SMOLLM2_135M), ("qwen3-0.6b-shape", QWEN3_0_6B)]

    def graph_limits(self) -> tuple[int, int]:
        """(cuda_graph_max_bs, cuda_graph_max_kv_len): the engine's defaults on a GPU."""
        if self.quick:
            return 2, 64
        return (8, 256) if self.rehearsal else (64, 4096)


# --- graphs: capture, logits per bucket, replays, the dummy slot ---------------------------------


def decode_batch(runner, n: int, kv_len: int, write_from: int, generator: torch.Generator) -> ForwardBatch:
    """A decode of n requests in table rows 0..n-1, the longest exactly kv_len tokens long: their
    earlier positions read random slots of the read-only region, each new token writes its own
    slot from ``write_from`` on (so batches never overwrite what another batch reads)."""
    device = runner.device
    lens = torch.randint(1, kv_len + 1, (n,), generator=generator).tolist()
    lens[0] = kv_len
    table = runner.req_to_token_pool.req_to_token
    page = runner.page_size
    for row, length in enumerate(lens):
        table[row, : length - 1] = torch.randint(page, page + READ_SLOTS, (length - 1,), generator=generator).to(device)
        table[row, length - 1] = write_from + row
    tokens = torch.randint(0, runner.model.config.vocab_size, (n,), generator=generator).tolist()
    out_cache_loc = torch.arange(write_from, write_from + n, device=device)
    return ForwardBatch.build(
        [[t] for t in tokens],
        [length - 1 for length in lens],
        runner.attn_backend,
        device=device,
        req_pool_indices=list(range(n)),
        out_cache_loc=out_cache_loc,
    )


def eager_logits(runner, batch: ForwardBatch, model=None, pool=None) -> torch.Tensor:
    """The same decode through stage 4's per-request attention over the same table, on the
    runner's model and K/V pool, or on the ``model`` and ``pool`` given (a float32 twin's)."""
    backend = PagedAttentionBackend(runner.req_to_token_pool, pool or runner.token_to_kv_pool)
    ref = ForwardBatch(
        batch.input_ids,
        batch.positions,
        batch.extend_lens,
        batch.seq_lens,
        backend,
        batch.req_pool_indices,
        batch.out_cache_loc,
    )
    backend.init_forward_metadata(ref)
    return (model or runner.model)(ref)


def float32_twin(runner, shape: dict, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """A float32 copy of the runner's model (``random_model(shape)``'s weights, drawn again and
    rounded to ``dtype`` as its own were) and of its K/V pool: bfloat16's values, widened, so a
    decode through it has bfloat16's inputs and none of its rounding."""
    model = random_model(shape, runner.device, torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(dtype))
    pool = copy.copy(runner.token_to_kv_pool)
    pool.k_buffer = [buffer.float() for buffer in pool.k_buffer]
    pool.v_buffer = [buffer.float() for buffer in pool.v_buffer]
    return model, pool


# float32: graph and eager agree to rounding. bfloat16 keeps 8 bits, and two correct paths that
# add in different orders differ by more than any fixed bound (0.06-0.19 in the logits of the
# random models on an H200, growing with the key length): each is measured against a float32
# twin instead, and the graph may be off by at most this factor times eager's error, plus a floor.
FLOAT32_TOLERANCE = (1e-3, 1e-3)  # absolute, relative to the largest logit
BFLOAT16_ERROR_FACTOR, BFLOAT16_ERROR_FLOOR = 2.0, 0.02


def graph_runner(ctx: Checks, model, max_bs: int | None = None, max_kv: int | None = None) -> GraphModelRunner:
    """A stage-8 runner with graphs for every bucket up to (max_bs, max_kv) (default: the mode's
    limits), and a pool with room for the read-only region plus every bucket's new tokens."""
    default_bs, default_kv = ctx.graph_limits()
    max_bs, max_kv = max_bs or default_bs, max_kv or default_kv
    writes = (
        sum(capture_bs_buckets(max_bs)) * len(kv_len_buckets(max_kv)) + max_bs
    )  # every bucket once, and the padded check
    return GraphModelRunner(
        model,
        pool_size=READ_SLOTS + writes,
        max_running_requests=max_bs,
        max_context_len=max_kv,
        attention_backend="torch",
        cuda_graph_max_bs=max_bs,
        cuda_graph_max_kv_len=max_kv,
    )


@torch.inference_mode()
def step_graphs(ctx: Checks, dtype: torch.dtype) -> None:
    for label, shape in ctx.shapes():
        model = random_model(shape, ctx.device, dtype)
        runner = None
        with ctx.check(f"{label}: capture at start") as record:
            runner = graph_runner(ctx, model)
            graphs = runner.cuda_graph_runner
            record["detail"] = graphs.describe()
            record["data"] = {
                "buckets": len(graphs.batches),
                "graphs": len(graphs.graphs),
                "capture_seconds": graphs.capture_seconds,
                "graph_memory_mib": graphs.graph_memory_bytes / 2**20,
            }
            expected = len(graphs.capture_bs) * len(graphs.capture_kv_lens)
            captured = len(graphs.graphs) if graphs.use_cuda_graph else len(graphs.batches)
            if captured != expected or (graphs.use_cuda_graph and list(graphs.graphs) != graphs.buckets):
                record["status"] = "FAIL"
                record["detail"] += (
                    f"; expected {expected} buckets captured largest first, got {list(graphs.graphs)[:6]}..."
                )
        if runner is None:
            continue
        graphs = runner.cuda_graph_runner
        pool = runner.token_to_kv_pool
        generator = torch.Generator().manual_seed(0)
        for buffer in pool.k_buffer + pool.v_buffer:
            buffer.normal_(0.0, 1.0)
        write_from = runner.page_size + READ_SLOTS
        twin = float32_twin(runner, shape, dtype) if dtype != torch.float32 else None
        absolute, relative = FLOAT32_TOLERANCE
        batches = {}
        with ctx.check(f"{label}: graph vs eager logits, every bucket") as record:
            worst: dict[str, Any] = {}
            failures, previous_bs = [], 0
            for bs in graphs.capture_bs:
                n = bs - 1 if bs - 1 > previous_bs else bs  # a padded batch where the bucket allows one
                previous_bs = bs
                for kv_len in graphs.capture_kv_lens:
                    batch = decode_batch(runner, n, kv_len, write_from, generator)
                    write_from += n
                    got = runner.forward(batch)
                    assert runner.last_forward_path == "graph", (
                        f"bucket ({bs}, {kv_len}) took the {runner.last_forward_path} path"
                    )
                    expected = eager_logits(runner, batch)
                    if (bs, kv_len) in (graphs.buckets[0], graphs.buckets[-1]):  # replayed again below
                        batches[bs, kv_len] = (batch, got, runner.req_to_token_pool.req_to_token[:n].clone())
                    if twin is None:
                        diff = (got - expected).abs().max().item()
                        worst[f"{bs}x{kv_len}"] = diff
                        if not diff <= absolute + relative * expected.abs().max().item():
                            failures.append(f"({bs}, {kv_len}): {diff:.3g}")
                    else:
                        truth = eager_logits(runner, batch, *twin).float()
                        graph_error = (got.float() - truth).abs().max().item()
                        eager_error = (expected.float() - truth).abs().max().item()
                        worst[f"{bs}x{kv_len}"] = {"graph": graph_error, "eager": eager_error}
                        if not graph_error <= BFLOAT16_ERROR_FACTOR * eager_error + BFLOAT16_ERROR_FLOOR:
                            failures.append(f"({bs}, {kv_len}): graph {graph_error:.3g}, eager {eager_error:.3g}")
            record["data"] = {"max_abs_diff_per_bucket" if twin is None else "max_abs_error_per_bucket": worst}
            if twin is None:
                record["detail"] = (
                    f"{len(worst)} buckets, largest difference {max(worst.values()):.3g} (tolerance {absolute} + "
                    f"{relative} x max|logit|)"
                )
            else:
                graph_worst = max(e["graph"] for e in worst.values())
                eager_worst = max(e["eager"] for e in worst.values())
                record["detail"] = (
                    f"{len(worst)} buckets; largest error against a float32 twin: graph {graph_worst:.3g}, "
                    f"eager {eager_worst:.3g} "
                    f"(a bucket passes when the graph's is at most {BFLOAT16_ERROR_FACTOR:g} x eager's + "
                    f"{BFLOAT16_ERROR_FLOOR:g})"
                )
            if failures:
                record["status"], record["detail"] = "FAIL", record["detail"] + f"; over it: {', '.join(failures[:8])}"
        del twin
        with ctx.check(f"{label}: earlier graphs replayed after later ones") as record:
            first, last = graphs.buckets[0], graphs.buckets[-1]  # the first captured (largest) and the last
            again = []
            for bucket in (first, last, first):
                batch, before, rows = batches[bucket]
                runner.req_to_token_pool.req_to_token[: len(rows)] = rows  # later batches reused the table rows
                again.append((bucket, (runner.forward(batch) - before).abs().max().item()))
            record["data"] = {"replays": again}
            record["detail"] = (
                ", ".join(f"{b}: {d:.3g}" for b, d in again) + " (difference from the first replay of each)"
            )
            if any(d != 0 for _, d in again):
                record["status"] = "FAIL"
        with ctx.check(f"{label}: padded rows write only the dummy slot") as record:
            bs = graphs.capture_bs[-1]
            n = (
                graphs.capture_bs[-2] + 1 if len(graphs.capture_bs) > 1 else bs
            )  # the most padding the largest bucket has
            batch = decode_batch(runner, n, graphs.capture_kv_lens[0], write_from, generator)
            before = [t.clone() for t in pool.k_buffer + pool.v_buffer]
            runner.forward(batch)
            assert graphs.bucket_for(n, max(batch.seq_lens))[0] == bs
            changed = set()
            for old, now in zip(before, pool.k_buffer + pool.v_buffer):
                changed |= set((old != now).flatten(1).any(dim=1).nonzero().flatten().tolist())
            allowed = set(batch.out_cache_loc.tolist()) | set(range(DUMMY_SLOT, runner.page_size))
            stray = sorted(changed - allowed)
            record["detail"] = (
                f"{n} requests padded to {bs}: slots written {sorted(changed)[:6]}...; outside the real rows' and "
                f"the dummy: {stray[:8]}"
            )
            if stray or not set(batch.out_cache_loc.tolist()) <= changed:
                record["status"] = "FAIL"
        del runner, model
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


# --- engine: tokens with graphs equal those without ---------------------------------------------


def logit_gap(model, prompt: list[int], output: list[int], a: int, b: int) -> float:
    """How far apart tokens a and b are in the eager logits after prompt + output (one plain prefill)."""
    batch = ForwardBatch.build([prompt + output], [0], NoCacheBackend(), device=model.device)
    logits = model(batch)[0]
    return abs(logits[a] - logits[b]).item()


@torch.inference_mode()
def step_engine(ctx: Checks, dtype: torch.dtype) -> None:
    label, shape = ctx.shapes()[0]
    model = random_model(shape, ctx.device, dtype)
    generator = torch.Generator().manual_seed(1)
    count, longest, most_new = (3, 40, 10) if ctx.quick else (12, 300, 40)
    lengths = torch.randint(3, longest, (count,), generator=generator).tolist()
    prompts = [torch.randint(0, shape["vocab_size"], (k,), generator=generator).tolist() for k in lengths]
    limits = torch.randint(most_new // 2, most_new, (count,), generator=generator).tolist()
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in limits]
    max_bs, max_kv = ctx.graph_limits()
    knobs: dict[str, Any] = dict(
        pool_size=8192,
        max_running_requests=count,
        chunked_prefill_size=256,
        cuda_graph_max_bs=max_bs,
        cuda_graph_max_kv_len=max_kv,
    )
    engines: list[Engine] = []
    with ctx.check(f"{label}: engine tokens with graphs = without") as record:
        with_graphs = Engine(model, None, disable_cuda_graph=False, **knobs)
        got = [o.output_ids for o in with_graphs.generate(prompts, params)]
        without = Engine(model, None, disable_cuda_graph=True, **knobs)
        expected = [o.output_ids for o in without.generate(prompts, params)]
        engines += [with_graphs, without]
        paths = dict(with_graphs.runner.forward_paths)
        assert paths.get("graph", 0) > 0, f"no decode took the graph path: {paths}"
        same = sum(a == b for a, b in zip(got, expected))
        ties: list[str] = []
        problems: list[str] = []
        for i, (a, b) in enumerate(zip(got, expected)):
            if a == b:
                continue
            j = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
            gap = logit_gap(model, prompts[i], b[:j], a[j], b[j])
            (ties if dtype != torch.float32 and gap <= 0.1 else problems).append(
                f"request {i} at token {j} (logit gap {gap:.3g})"
            )
        record["data"] = {"identical": same, "requests": count, "paths": paths, "near_ties": ties, "problems": problems}
        record["detail"] = f"{same}/{count} requests identical, decodes {paths}"
        if ties:
            record["detail"] += f"; the others part at near-ties of the eager logits: {', '.join(ties[:4])}"
        if problems:
            record["status"], record["detail"] = (
                "FAIL",
                record["detail"] + f"; differ beyond rounding: {', '.join(problems[:4])}",
            )
    if dtype == torch.float32 and engines:  # (in bfloat16 graph and eager part at near-ties, as above)
        engine_options(ctx, label, engines, prompts, limits)


def engine_options(ctx: Checks, label: str, engines: list[Engine], prompts, limits) -> None:
    """The same requests, on the same two engines (no second capture), with every sampling option
    but grammars: seeded top-k / top-p / min-p, penalties, logit_bias, logprobs. Each reaches the
    logits beside the graph (the sampler, the penalty counts on the device, the logprob table), so
    the first run checks them on CUDA even if the second run (tests/gpu) never comes."""
    options: list[dict[str, Any]] = [
        dict(temperature=0.8, seed=1, top_k=40, logprobs=3),
        dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=1),
        dict(temperature=1.0, seed=2, top_p=0.9, min_p=0.05, presence_penalty=0.5),
        dict(temperature=0, logit_bias={7: 5.0, 11: -100.0}, logprobs=0),
    ]
    params = [
        SamplingParams(max_new_tokens=n, ignore_eos=True, **options[i % len(options)]) for i, n in enumerate(limits)
    ]
    with ctx.check(f"{label}: every sampling option, tokens and logprobs with graphs = without") as record:
        with_graphs, without = (engine.generate(prompts, params) for engine in engines)
        same = sum(a.output_ids == b.output_ids for a, b in zip(with_graphs, without))
        gaps = [
            abs(x.logprob - y.logprob)
            for a, b in zip(with_graphs, without)
            if a.output_ids == b.output_ids and a.logprobs is not None
            for x, y in zip(a.logprobs, b.logprobs)
        ]
        banned = sum(
            token in out.output_ids
            for out, p in zip(with_graphs, params)
            for token, bias in p.logit_bias.items()
            if bias == -100
        )
        record["data"] = {"identical": same, "requests": len(prompts), "largest_logprob_gap": max(gaps, default=0.0)}
        record["detail"] = (
            f"{same}/{len(prompts)} requests identical; logprobs within {max(gaps, default=0.0):.2e} of eager"
        )
        assert same == len(prompts) and max(gaps, default=0.0) < 1e-3 and not banned, (
            f"{record['detail']}; a banned token came {banned} times"
        )


# --- stage 10: the overlapped engine on its forward stream ---------------------------------------


@torch.inference_mode()
def step_overlap(ctx: Checks) -> None:
    """Stage 10's engine (worker thread + its own CUDA stream, graphs replayed inside the worker):
    the tokens of stage 8's engine, and the throughput with overlap off vs on (the GPU figure the
    lesson waits for)."""
    label, shape = ctx.shapes()[0]
    model = random_model(shape, ctx.device, torch.float32)
    generator = torch.Generator().manual_seed(2)
    count, new = (4, 8) if ctx.quick else (32, 64)
    prompts = [torch.randint(0, shape["vocab_size"], (16,), generator=generator).tolist() for _ in range(count)]
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    max_bs, max_kv = ctx.graph_limits()
    knobs: dict[str, Any] = dict(
        pool_size=8192,
        max_running_requests=count,
        cuda_graph_max_bs=max_bs,
        cuda_graph_max_kv_len=max_kv,
        disable_cuda_graph=False,
    )
    with ctx.check(f"{label}: overlapped engine tokens = stage 8's; throughput overlap off vs on") as record:
        expected = [o.output_ids for o in Engine(model, None, **knobs).generate(prompts, params)]
        seconds = {}
        for name in ("off", "on"):
            engine = OverlapEngine(model, None, disable_overlap=name == "off", **knobs)
            engine.generate(prompts[:2], params)  # warm-up
            start = time.perf_counter()
            got = [o.output_ids for o in engine.generate(prompts, params)]
            seconds[name] = time.perf_counter() - start
            assert got == expected, f"overlap {name}: tokens differ from stage 8's engine"
            if name == "on":
                paths = dict(engine.runner.forward_paths)
                assert paths.get("graph", 0) > 0, f"no decode replayed a graph inside the worker: {paths}"
                assert (engine.scheduler.worker.stream is not None) == (ctx.device.type == "cuda"), (
                    "the worker's stream"
                )
        tokens = count * new
        record["data"] = {
            "requests": count,
            "new_tokens": new,
            "seconds": seconds,
            "paths": paths,
            "tokens_per_s": {k: tokens / v for k, v in seconds.items()},
        }
        record["detail"] = (
            f"tokens identical; {tokens / seconds['off']:.0f} tok/s off, {tokens / seconds['on']:.0f} on "
            f"({seconds['off'] / seconds['on']:.2f}x), decodes {paths}"
        )


# --- SDPA: which kernel the graph decode runs, and what attention costs on each ----------------


def attention_ops(run) -> list[str]:
    """The attention operators (aten's SDPA variants) that ``run()`` dispatches to, seen by the
    profiler (a Python dispatch mode does not see below SDPA under inference mode)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        run()
    return sorted(
        {e.name for e in profile.events() if "attention" in e.name and e.name != "aten::scaled_dot_product_attention"}
    )


def ms_per_call(device: torch.device, backends: list[SDPBackend], fn, *args, calls: int = 10, **kwargs) -> float:
    """Milliseconds a call of ``fn(*args, **kwargs)`` takes on only these SDPA kernels, after one
    untimed call; RuntimeError ("No available kernel") when they all refuse it."""
    with sdpa_kernel(backends):
        fn(*args, **kwargs)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args, **kwargs)
        synchronize(device)
    return (time.perf_counter() - start) * 1000 / calls


@torch.inference_mode()
def step_sdpa(ctx: Checks) -> None:
    kv_len = 64 if ctx.quick else (256 if ctx.rehearsal else 1024)
    for dtype in (torch.float32, torch.bfloat16):
        for label, shape in ctx.shapes():
            heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
            with ctx.check(f"{label}, {str(dtype).removeprefix('torch.')}: the graph decode's SDPA kernel") as record:
                model = random_model(dict(shape, num_hidden_layers=1), ctx.device, dtype)
                runner = graph_runner(ctx, model, max_bs=8, max_kv=kv_len)
                graphs = runner.cuda_graph_runner
                batch = decode_batch(runner, 8, kv_len, runner.page_size + READ_SLOTS, torch.Generator().manual_seed(2))
                record["data"]["bucket"] = (8, kv_len)
                bucket = graphs.replay_prepare(batch)
                # the bucket's static batch, run eagerly: the operators its graph recorded

                def run_static(model=graphs.model, batch=graphs.batches[bucket]):
                    return model(batch, return_all_logits=True)

                selected = attention_ops(run_static)
                bs, length = bucket
                # the graph decode's call (attend_decode): each KV head's query heads in the query dimension
                q = torch.randn(bs, kv_heads, heads // kv_heads, head_dim, device=ctx.device, dtype=dtype)
                k = torch.randn(bs, length, kv_heads, head_dim, device=ctx.device, dtype=dtype).transpose(1, 2)
                mask = torch.rand(bs, 1, 1, length, device=ctx.device) < 0.9
                eligible = {}
                for backend in (
                    SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.FLASH_ATTENTION,
                    SDPBackend.MATH,
                ):
                    try:
                        ms = ms_per_call(
                            ctx.device,
                            [backend],
                            F.scaled_dot_product_attention,
                            q,
                            k,
                            k,
                            attn_mask=mask,
                        )
                        eligible[backend.name] = f"{ms:.3f} ms"
                    except RuntimeError as error:
                        eligible[backend.name] = "refused"
                        record["data"].setdefault("refusals", {})[backend.name] = str(error)[:400]
                record["data"].update(selected=selected, backends=eligible)
                record["detail"] = f"bucket {bucket}: runs {selected or ['(none seen)']}; each alone: " + ", ".join(
                    f"{name} {how}" for name, how in eligible.items()
                )
    new_lengths_cost_what_repeated_ones_do(ctx)
    cudnn_attention_in_a_graph(ctx)
    gqa_by_copy_or_by_math(ctx)


def cudnn_attention_in_a_graph(ctx: Checks) -> None:
    """A measurement for a decision, not a check of the engine (which keeps cuDNN out of SDPA):
    may a graph capture cuDNN's attention? Its plan would be built once per bucket at capture, and
    on the H200 its kernel was ~3x the math kernel's speed on a decode bucket, but a bfloat16 graph
    that ran it replayed the same inputs up to 0.1 apart. One bucket-shaped decode attention on
    cuDNN alone: run eagerly twice, one graph replayed twice, and replayed again after a second
    graph was captured into the same memory pool. A difference between the eager runs: the kernel
    is not deterministic; only between the replays: capturing it is not safe."""
    label, shape = ctx.shapes()[-1]
    with ctx.check(f"{label}, bfloat16: cuDNN attention run twice, replayed twice, replayed after a capture") as record:
        if ctx.device.type != "cuda":
            record["status"], record["detail"] = "SKIP", "no cuDNN attention on a CPU"
            return
        heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
        bs, length = 8, 1024
        generator = torch.Generator(device=ctx.device).manual_seed(3)

        def draw(*size):
            return torch.randn(*size, device=ctx.device, dtype=torch.bfloat16, generator=generator)

        inputs = {  # each shape its own tensors, laid out as the graph decode's gathered keys are
            keys: (
                draw(bs, heads, 1, head_dim),
                draw(bs, keys, kv_heads, head_dim).transpose(1, 2),
                draw(bs, keys, kv_heads, head_dim).transpose(1, 2),
                torch.rand(bs, 1, 1, keys, device=ctx.device, generator=generator) < 0.9,
            )
            for keys in (length, length // 2)
        }

        def attend(keys: int) -> torch.Tensor:
            q, k, v, mask = inputs[keys]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        def apart(a: torch.Tensor, b: torch.Tensor) -> float:
            return (a.float() - b.float()).abs().max().item()

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            first, second = attend(length), attend(length)
            attend(length // 2)  # both shapes' plans built before capture
            pool = torch.cuda.graph_pool_handle()
            graph, other = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = attend(length)
            graph.replay()
            replayed = out.clone()
            graph.replay()
            again = out.clone()
            with torch.cuda.graph(other, pool=pool):
                attend(length // 2)
            other.replay()
            graph.replay()
            after = out.clone()
            torch.cuda.synchronize()
        record["data"] = {
            "eager_twice": apart(first, second),
            "replay_vs_eager": apart(replayed, first),
            "replayed_twice": apart(replayed, again),
            "replayed_after_another_capture": apart(replayed, after),
        }
        record["detail"] = ", ".join(f"{name.replace('_', ' ')} {d:.3g}" for name, d in record["data"].items()) + (
            " (max difference)"
        )


def gqa_by_copy_or_by_math(ctx: Checks, calls: int = 10) -> None:
    """A measurement for a decision: without cuDNN, grouped-query attention in bfloat16 runs the math
    kernel (flash and memory-efficient refuse dense inputs with fewer K/V heads than query heads).
    Copying each K/V head to its query heads first (``repeat_interleave``) lets them run: is the copy
    plus the fused kernel faster? A decode has a third way, with no copy: its one query per head
    lets the query heads of each K/V head stand in the query-length dimension ([n, KVH, G, D]
    against keys [n, KVH, kv_len, D]), so the head counts match (the grouping of FlashInfer's and
    SGLang's decode kernels); its largest difference from the math kernel's output is recorded.
    Timed for a decode bucket (8 rows x 1024 keys, masked: the graph's call) and a 1024-token
    prompt (causal: a prefill's call), ms a call, any copy included."""
    label, shape = ctx.shapes()[-1]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    group = heads // kv_heads
    with ctx.check(f"{label}, bfloat16: GQA on the math kernel, or K/V copied to every head on a fused one") as record:
        generator = torch.Generator(device=ctx.device).manual_seed(4)

        def draw(*size):
            return torch.randn(*size, device=ctx.device, dtype=torch.bfloat16, generator=generator)

        mask = torch.rand(8, 1, 1, 1024, device=ctx.device) < 0.9
        cases = {
            "decode 8x1024": (draw(8, heads, 1, head_dim), draw(8, kv_heads, 1024, head_dim), {"attn_mask": mask}),
            "prefill 1024": (draw(1, heads, 1024, head_dim), draw(1, kv_heads, 1024, head_dim), {"is_causal": True}),
        }

        def math_gqa(q, k, how):
            return F.scaled_dot_product_attention(q, k, k, enable_gqa=True, **how)

        def copied(q, k, how):
            full = k.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, full, full, **how)

        def grouped(q, k, how):
            n, _, queries, d = q.shape
            if queries != 1:
                raise ValueError("only a decode's single query can be grouped this way")
            return F.scaled_dot_product_attention(q.view(n, kv_heads, group, d), k, k, **how).view(n, heads, 1, d)

        ways = {
            "math, enable_gqa": ([SDPBackend.MATH], math_gqa),
            "copy + efficient": ([SDPBackend.EFFICIENT_ATTENTION], copied),
            "copy + flash": ([SDPBackend.FLASH_ATTENTION], copied),
            "grouped + efficient": ([SDPBackend.EFFICIENT_ATTENTION], grouped),
            "grouped + math": ([SDPBackend.MATH], grouped),
        }
        rows = {}
        for name, (q, k, how) in cases.items():
            row = {}
            for way, (backends, run) in ways.items():
                try:
                    row[way] = f"{ms_per_call(ctx.device, backends, run, q, k, how, calls=calls):.3f} ms"
                except RuntimeError:
                    row[way] = "refused"
                except ValueError:
                    row[way] = "n/a"
            rows[name] = row
        q, k, how = cases["decode 8x1024"]
        with sdpa_kernel([SDPBackend.MATH]):
            apart = (grouped(q, k, how).float() - math_gqa(q, k, how).float()).abs().max().item()
        record["data"] = {"ms_per_call": rows, "grouped_vs_math_max_diff": apart}
        record["detail"] = (
            "; ".join(f"{name}: " + ", ".join(f"{way} {ms}" for way, ms in row.items()) for name, row in rows.items())
            + f"; grouped vs math (decode) {apart:.3g}"
        )


def new_lengths_cost_what_repeated_ones_do(ctx: Checks, count: int = 64) -> None:
    """Per-request attention (stage 1-7's ``causal_attention``) at ``count`` lengths it has not seen,
    then at the same lengths again, for a decode (1 query) and a 16-token extend, in bfloat16 on the
    kernels a loaded model leaves SDPA. A kernel that builds a plan per shape (cuDNN's: 38-101 ms a
    call on an H200, against 0.16-2.5 ms) makes the first pass many times the second."""
    label, shape = ctx.shapes()[-1]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    avoid_cudnn_attention(ctx.device)  # what load_model does on CUDA
    with ctx.check(f"{label}, bfloat16: attention at new lengths costs what it does at repeated ones") as record:
        rows = []
        for queries in (1, 16):
            lengths = range(1000 + 100 * queries, 1000 + 100 * queries + count)
            passes = []
            for _ in range(2):  # new lengths, then the same again
                start = time.perf_counter()
                for length in lengths:
                    q = torch.randn(queries, heads, head_dim, device=ctx.device, dtype=torch.bfloat16)
                    k = torch.randn(length, kv_heads, head_dim, device=ctx.device, dtype=torch.bfloat16)
                    causal_attention(q, k, k)
                synchronize(ctx.device)
                passes.append((time.perf_counter() - start) * 1000 / count)
            rows.append({"queries": queries, "new_ms": round(passes[0], 3), "repeated_ms": round(passes[1], 3)})
        record["data"] = {"rows": rows}
        record["detail"] = "; ".join(
            f"{r['queries']} quer{'y' if r['queries'] == 1 else 'ies'}: {r['new_ms']:.3f} ms a call at a new length, "
            f"{r['repeated_ms']:.3f} ms repeated"
            for r in rows
        )
        if any(r["new_ms"] > 3 * r["repeated_ms"] + 0.5 for r in rows):
            record["status"] = "FAIL"
            record["detail"] += " (new lengths should cost at most 3x + 0.5 ms: a kernel builds a plan per shape)"


# --- decode latency ----------------------------------------------------------------------------


def step_latency(ctx: Checks) -> None:
    sizes = (1, 2) if ctx.quick else ((1, 8, 32) if ctx.rehearsal else (1, 8, 32, 64))
    context_len = 64 if ctx.rehearsal else 512
    steps = 2 if ctx.quick else (3 if ctx.rehearsal else 10)
    for label, shape in ctx.shapes()[-1:]:  # the Qwen3 shape: issue 7's figure
        model = random_model(shape, ctx.device, torch.bfloat16)
        with ctx.check(f"{label}, bfloat16: decode step latency, context {context_len}") as record:
            rows = []
            for bs in sizes:
                row: dict[str, Any] = {"batch_size": bs}
                for path in ("loop", "batched", "graph"):  # on a GPU "gathered" is "batched"
                    result = decode_step_latency(model, bs, context_len, path, steps=steps, warmup=2)
                    row[f"{path}_ms"] = round(1000 * result["seconds"], 3)
                    if path == "graph":
                        row["bucket"], row["capture_s"] = result["bucket"], round(result["capture_seconds"], 2)
                row["graph_speedup"] = round(row["batched_ms"] / row["graph_ms"], 2)
                rows.append(row)
                print(row, flush=True)
            record["data"] = {"rows": rows, "device": describe(ctx.device)}
            record["detail"] = "; ".join(
                f"bs {r['batch_size']}: loop {r['loop_ms']:.2f} / batched {r['batched_ms']:.2f} / graph "
                f"{r['graph_ms']:.2f} ms "
                f"({r['graph_speedup']:.2f}x)"
                for r in rows
            )
        del model


def run(name: str, result_file: Path, rehearsal: bool, quick: bool) -> int:
    set_torch_threads()
    ctx = Checks(result_file, rehearsal, quick)
    print(f"step {name} on {describe(ctx.device)}", flush=True)
    steps = {
        "graphs-float32": lambda: step_graphs(ctx, torch.float32),
        "graphs-bfloat16": lambda: step_graphs(ctx, torch.bfloat16),
        "engine-float32": lambda: step_engine(ctx, torch.float32),
        "engine-bfloat16": lambda: step_engine(ctx, torch.bfloat16),
        "sdpa-kernel": lambda: step_sdpa(ctx),
        "decode-latency": lambda: step_latency(ctx),
        "overlap": lambda: step_overlap(ctx),
    }
    steps[name]()
    return 0 if all(c["status"] != "FAIL" for c in ctx.done) else 1
