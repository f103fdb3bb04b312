"""Measure one decode step of a batch: the milestone, the notebook, tools/benchmark_decode.py and
tools/gpu_check.py use it.

``decode_step_latency(model, batch_size, context_len, path)`` gives ``batch_size`` requests
``context_len`` tokens of context (``fill_context``: random K/V written straight into the pool,
no prefill), runs a few decode steps to warm up, then times ``runner.forward`` of the next
decode steps on one of five paths::

    "loop"      stage 4's runner: attention request by request (SDPA per request and layer)
    "gathered"  stage 8's runner without graphs, attending over the gathered [bs, kv_len] block:
                one SDPA per layer (what a GPU's eager decode does)
    "table"     the same, reading K/V through the table by two library operations (table_attention.py)
    "batched"   stage 8's runner without graphs, as the engine runs it: on a CPU the fused kernel
                (decode_kernel.py; "table" where it cannot be built), elsewhere the same as "gathered"
    "graph"     stage 8's runner replaying the bucket's CUDA graph (on a CPU: its padded
                static batch, run eagerly)

The static-buffer copies and metadata refills of the graph path are included; the scheduler's
host work (slot allocation, building the batch) is left out, as it is the same on every path.

``bare_forward_latency(model, batch_size)`` times the same model pass with attention and the KV
pool taken out (``BareAttention``): the ceiling a decode step could reach, everything else equal.

``memory_floor(model, batch_size, context_len, bare_seconds, read_rate)`` is the least a decode
step can take on a device that streams memory at ``read_rate`` bytes a second
(``memory_read_rate``): the bare pass plus one read of every key and value in context. No
attention can do better than read them once, so "batched / floor" is the part of a step that
better code could still remove.

``random_model`` builds a model of any shape with random weights (no download), e.g.
``SMOLLM2_135M`` or ``QWEN3_0_6B``: the default model's and Qwen3-0.6B's shapes.
"""

from __future__ import annotations

import time

import torch

from s00_foundation.attention import AttentionBackend
from s00_foundation.config import ModelConfig
from s00_foundation.device import avoid_cudnn_attention
from s00_foundation.forward_batch import ForwardBatch
from s00_foundation.model import CausalLM
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool.engine import prepare_forward
from s04_paged_kv_pool.model_runner import ModelRunner

from .model_runner import GraphModelRunner

SMOLLM2_135M = dict(  # HuggingFaceTB/SmolLM2-135M-Instruct's config.json, the fields the engine reads
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)
QWEN3_0_6B = dict(  # Qwen/Qwen3-0.6B's config.json, the fields the engine reads
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
)
SMALL_QWEN3 = dict(
    QWEN3_0_6B,
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)  # a CPU-sized stand-in
SMALL_SMOLLM2 = dict(SMOLLM2_135M, vocab_size=4096, hidden_size=192, intermediate_size=512, num_hidden_layers=4)

PATHS = ("loop", "gathered", "table", "batched", "graph")


def random_model(raw_config: dict, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A ``CausalLM`` of the given config.json fields with random weights (N(0, 0.02), norms 1),
    drawn on ``device`` itself (a GPU fills Qwen3-0.6B's 600M weights in milliseconds)."""
    config = ModelConfig.from_dict(raw_config)
    avoid_cudnn_attention(device)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.to(dtype).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_step_latency(
    model: CausalLM,
    batch_size: int,
    context_len: int,
    path: str = "batched",
    steps: int = 10,
    warmup: int = 3,
    seed: int = 0,
    enable_torch_compile: bool = False,
) -> dict:
    """Seconds per decode step (the median of ``steps``) of ``batch_size`` requests with about
    ``context_len`` tokens in context, on ``path`` (one of ``PATHS``, see above).
    Returns {"seconds", "path", "bucket", "backend", "capture_seconds"}: the runner path the steps
    took, their bucket (graph path), the attention backend and the graphs' capture time.
    ``enable_torch_compile`` compiles each layer's MLP and RMSNorms (torch_compile.py); attention stays eager."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    longest = context_len + warmup + steps + 1
    shape = (
        batch_size * longest,
        1,
        batch_size,
        longest,
    )  # pool_size, page_size, max_running_requests, max_context_len
    if path == "loop":
        runner = ModelRunner(model, *shape)
    else:
        runner = GraphModelRunner(
            model,
            *shape,
            cuda_graph_max_bs=batch_size,
            disable_cuda_graph=path != "graph",
            enable_torch_compile=enable_torch_compile,
        )
        if path in ("gathered", "table"):
            runner.attn_backend.decode_path = path
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0, max_new_tokens=longest, ignore_eos=True)
    reqs = [
        Req(i, torch.randint(vocab // 10, vocab // 2, (context_len,), generator=generator).tolist(), params)
        for i in range(batch_size)
    ]
    fill_context(runner, reqs, seed)
    times = []
    for step in range(warmup + steps):  # the warm-up decodes, then the timed ones
        batch = prepare_forward(runner, reqs)
        synchronize(runner.device)
        start = time.perf_counter()
        logits = runner.forward(batch)
        synchronize(runner.device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
        for req, token in zip(reqs, logits.argmax(-1).tolist()):
            req.cached_len = req.device_len
            req.append_token(token)
    graph = getattr(runner, "cuda_graph_runner", None)
    bucket = graph.bucket_for(batch_size, reqs[0].cached_len) if graph is not None else None
    return {
        "seconds": sorted(times)[len(times) // 2],
        "path": getattr(runner, "last_forward_path", "eager"),
        "bucket": bucket,
        "backend": runner.attention_backend_name,
        "capture_seconds": graph.capture_seconds if graph is not None else 0.0,
    }


def fill_context(runner: ModelRunner, reqs: list[Req], seed: int = 0) -> None:
    """Store K/V for every request's prompt but its last token, as a prefill would, without running
    one: a table row each, slots from the allocator (contiguous per request, as a prefill gets
    them), random values in every layer. A decode step's time does not depend on the values it
    reads, and on a CPU the prefill of 32 requests x 128 tokens takes as long as ~50 decode steps.
    The next pass sends each prompt's last token: a decode."""
    n = len(reqs[0].origin_input_ids) - 1
    rows = runner.req_to_token_pool.alloc(len(reqs))
    slots = runner.allocator.alloc_extend([0] * len(reqs), [n] * len(reqs), [0] * len(reqs))
    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    for i, (req, row) in enumerate(zip(reqs, rows)):
        table[row, :n] = slots[i * n : (i + 1) * n]
        req.req_pool_idx, req.cached_len = row, n
    key = pool.get_key_buffer(0)
    generator = torch.Generator(device=key.device).manual_seed(seed)
    shape = (len(slots), *key.shape[1:])
    k, v = (torch.randn(shape, generator=generator, device=key.device).to(key.dtype) for _ in "kv")
    for layer_id in range(len(pool.k_buffer)):  # the same values in every layer: only the reads count
        pool.set_kv_buffer(layer_id, slots, k, v)


class BareAttention(AttentionBackend):
    """No attention and no KV storage: each token's output is its own query. A model pass with it
    is everything else a pass does (embedding, projections, norms, MLP, logits): the ceiling of any
    attention backend and any scheduler."""

    def forward(self, q, k, v, layer_id, batch):
        return q


def kv_bytes(model: CausalLM, batch_size: int, context_len: int) -> int:
    """Bytes of K and V a decode step of ``batch_size`` requests of ``context_len`` tokens reads:
    every layer, every KV head, once (the KV pool holds the model's dtype)."""
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * model.dtype.itemsize
    return batch_size * context_len * per_token


@torch.inference_mode()
def memory_read_rate(device: torch.device | str, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes a second this device reads a buffer far larger than its caches (the best of
    ``repeats`` sums over ``megabytes``; on a CPU with torch's threads): the rate a decode's K/V
    reads cannot beat. A sum reads every byte once and writes nothing, as a decode's K/V reads do."""
    device = torch.device(device)
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


def memory_floor(model: CausalLM, batch_size: int, context_len: int, bare_seconds: float, read_rate: float) -> float:
    """Seconds a decode step cannot go below: the bare pass (``bare_seconds``) plus reading the
    step's K/V once at ``read_rate`` bytes a second."""
    return bare_seconds + kv_bytes(model, batch_size, context_len) / read_rate


@torch.inference_mode()
def bare_forward_latency(model: CausalLM, batch_size: int, context_len: int = 128, steps: int = 10) -> float:
    """Seconds (median of ``steps``, after a warm-up) of a decode-shaped pass of ``batch_size``
    requests with ``BareAttention``."""
    batch = ForwardBatch.build([[1]] * batch_size, [context_len] * batch_size, BareAttention(), device=model.device)
    times = []
    for step in range(steps + 1):
        synchronize(model.device)
        start = time.perf_counter()
        model(batch)
        synchronize(model.device)
        if step:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
