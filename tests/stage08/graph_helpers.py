"""Shared by the stage-8 tests: stage 8's runner and stage 4's eager runner driven through the same
requests step by step (same allocations, so the same slots), a snapshot of the KV pool, and a
decode backend over a random pool with rows of given lengths."""

from __future__ import annotations

import torch

from cpu_build import require_built
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool.engine import prepare_forward
from s04_paged_kv_pool.memory_pool import ReqToTokenPool, TokenToKVPool
from s04_paged_kv_pool.model_runner import ModelRunner
from s08_cuda_graph import decode_kernel
from s08_cuda_graph.decode_attention import DecodeAttentionBackend, DecodeMetadata
from s08_cuda_graph.model_runner import GraphModelRunner

POOL_SIZE, MAX_CONTEXT = 512, 256


def runners(model, max_bs: int = 8, max_running_requests: int = 16, **knobs):
    """(stage 8 runner, stage 4 runner) over the same model, with pools of the same shape."""
    shape = dict(pool_size=POOL_SIZE, max_running_requests=max_running_requests, max_context_len=MAX_CONTEXT, **knobs)
    return GraphModelRunner(model, cuda_graph_max_bs=max_bs, attention_backend="torch", **shape), ModelRunner(
        model, attention_backend="torch", **shape
    )


def start(runner, prompts) -> list[Req]:
    """Requests for ``prompts`` holding table rows of ``runner`` (not run yet)."""
    params = SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True)
    reqs = [Req(i, prompt, params) for i, prompt in enumerate(prompts)]
    for req, row in zip(reqs, runner.req_to_token_pool.alloc(len(reqs))):
        req.req_pool_idx = row
    return reqs


def run_pass(runner, reqs, tokens: list[int] | None = None):
    """One forward pass of ``reqs`` on ``runner``: returns (the ForwardBatch, logits). Then every
    request is marked cached and appends ``tokens[i]`` (default: its greedy token)."""
    batch = prepare_forward(runner, reqs)
    logits = runner.forward(batch)
    if tokens is None:
        tokens = logits.argmax(-1).tolist()
    for req, token in zip(reqs, tokens):
        req.cached_len = req.device_len
        req.append_token(token)
    return batch, logits


def pool_bytes(runner) -> torch.Tensor:
    """Every layer's K and V of every slot, as one [num_slots, 2 * layers, kv_heads, head_dim] tensor (a copy)."""
    pool = runner.token_to_kv_pool
    return torch.stack([t for k, v in zip(pool.k_buffer, pool.v_buffer) for t in (k, v)], dim=1).clone()


def prompts_of(count: int, first: int = 65) -> list[list[int]]:
    """``count`` prompts of different lengths (3 + 2i mod 11 tokens: 3, 5, ..., 13, then 4, 6, ...)."""
    return [[first + i] + [32 + (7 * i + 3 * j) % 90 for j in range(2 + 2 * i % 11)] for i in range(count)]


def backend_with_rows(num_kv_heads: int, lengths: list[int], head_dim: int = 16, seed: int = 0):
    """(backend, decode metadata filled by your ``fill_decode_metadata``) over a random one-layer
    pool whose table rows hold ``lengths`` tokens in scattered slots (a length-0 entry is a padding
    row: the dummy row of slot 0, seq_len 1). Request i holds table row n + 1 - i of n + 2 (the
    rows reversed, past two unused ones), so metadata read from rows 0..n-1 shows."""
    generator = torch.Generator().manual_seed(seed)
    num_slots = 1 + sum(lengths) + 7
    kv = TokenToKVPool(num_slots - 1, 1, num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim)
    kv.k_buffer[0].copy_(torch.randn(kv.k_buffer[0].shape, generator=generator))
    kv.v_buffer[0].copy_(torch.randn(kv.v_buffer[0].shape, generator=generator))
    table = ReqToTokenPool(len(lengths) + 2, max(lengths) + 3)
    rows = torch.arange(len(lengths) + 1, 1, -1)
    slots = (torch.randperm(num_slots - 1, generator=generator) + 1).tolist()  # never slot 0
    for row, n in zip(rows.tolist(), lengths):
        table.req_to_token[row, :n] = torch.tensor(slots[:n])
        slots = slots[n:]
    backend = DecodeAttentionBackend(table, kv)
    seq_lens = torch.tensor([max(n, 1) for n in lengths], dtype=torch.int32)
    kv_len = int(seq_lens.max())
    meta = DecodeMetadata(
        torch.empty(len(lengths), kv_len, dtype=torch.int64),
        torch.empty(len(lengths), kv_len, dtype=torch.bool),
        seq_lens,
    )
    backend.fill_decode_metadata(meta, rows)
    check_decode_metadata(meta, rows, table.req_to_token, lengths)
    return backend, meta


def check_decode_metadata(meta, rows: torch.Tensor, req_to_token: torch.Tensor, lengths: list[int]) -> None:
    """Your ``fill_decode_metadata``'s tables, checked before anything attends with them: row i's
    key mask is True for j < seq_len only, and its kv_indices there are the slots of table row
    ``rows[i]`` (past seq_len they are masked: any slot will do)."""
    for i, n in enumerate(lengths):
        seq_len, row = int(meta.seq_lens[i]), int(rows[i])
        got, want = meta.kv_indices[i, :seq_len].tolist(), req_to_token[row, :seq_len].tolist()
        assert got == want, (
            f"fill_decode_metadata: kv_indices row {i} should start with the first {seq_len} slots of its request's "
            f"table row, req_to_token[req_pool_indices[{i}]] = req_to_token[{row}]: {want}, got {got}"
        )
        keys = meta.key_mask[i].nonzero().flatten().tolist()
        assert keys == list(range(seq_len)), (
            f"fill_decode_metadata: key_mask row {i} (seq_len {seq_len}, its new token included"
            f"{'; a padding row' if n == 0 else ''}) should be True for the keys j < {seq_len} only, got True at {keys}"
        )


def built_kernel() -> decode_kernel.DecodeKernel:
    """The fused CPU kernels (decode and extend), built; a skip with the reason where nothing here
    can build them, a failure where a C++ compiler is here and the build failed."""
    loaded = decode_kernel.load()
    require_built(loaded.op is not None, loaded.how, "the fused CPU attention kernels")
    return loaded


def static_batch_problems(graph, batch) -> list[str]:
    """What the graph runner's static buffers and its bucket's metadata get wrong about ``batch``
    after a replay of it (empty when they hold it, padded): names the buffer, so a wrong replay
    says where, not only that its logits differ."""
    n = batch.num_reqs
    bs, kv_len = graph.bucket_for(n, max(batch.seq_lens))
    problems = []
    for name in ("input_ids", "positions", "req_pool_indices", "out_cache_loc"):
        got, want = getattr(graph, name)[:n].tolist(), getattr(batch, name).tolist()
        if got != want:
            problems.append(f"static {name}[:{n}] is {got}, the batch's is {want} (copy_ it in)")
    seq_lens, want = graph.seq_lens[:n].tolist(), (batch.positions + 1).tolist()
    if seq_lens != want:
        problems.append(f"static seq_lens[:{n}] is {seq_lens}, the batch's lengths are {want} (positions + 1)")
    padding = (graph.req_pool_indices[n:bs].tolist(), graph.out_cache_loc[n:bs].tolist(), graph.seq_lens[n:bs].tolist())
    if padding != ([graph.dummy_req_pool_idx] * (bs - n), [0] * (bs - n), [1] * (bs - n)):
        problems.append(f"padding rows {n}..{bs - 1} (table rows, slots, lengths) are {padding}: not dummy requests")
    backend = graph.attn_backend
    meta = backend.bucket_metadata[bs, kv_len]
    for name, buffer in (("kv_indices", backend.cuda_graph_kv_indices), ("key_mask", backend.cuda_graph_key_mask)):
        if getattr(meta, name).data_ptr() != buffer.data_ptr():
            problems.append(
                f"bucket ({bs}, {kv_len})'s metadata {name} is no longer a view of the graph's buffer: "
                f"fill_decode_metadata must write into meta.{name} in place (copy_), not assign a new tensor"
            )
    slots = graph.attn_backend.req_to_token_pool.req_to_token[graph.req_pool_indices[:bs], :kv_len]
    keys = torch.arange(kv_len)[None, :] < graph.seq_lens[:bs, None]
    if not (torch.equal(meta.key_mask, keys) and torch.equal(meta.kv_indices[keys], slots[keys])):
        problems.append(
            f"bucket ({bs}, {kv_len})'s metadata views (kv_indices, key_mask) do not describe the rows now in the "
            "static buffers: refill the bucket's own views (init_forward_metadata_replay_cuda_graph with its bs and "
            "kv_len), after the batch is copied in and padded"
        )
    return problems
