"""Decode attention for the whole batch at once: one attention call per layer, eager or replayed.

Stage 4's backend attends request by request: a decode step of 64 requests runs 64 small SDPA
calls (plus their transposes and slices) in every layer, and prepares its index arrays on the
host (``.tolist()``, a Python loop, an array as long as all the contexts together). That is slow
on any device, and a CUDA graph cannot record it at all. A decode sends one query per request,
so the whole batch fits one dense block instead::

    decode metadata (bs requests, keys up to kv_len), built on the device once per step

    kv_indices [bs, kv_len]   kv_indices[i, j] = req_to_token[req_pool_indices[i], j]
    key_mask   [bs, kv_len]   key_mask[i, j]   = j < seq_lens[i]

    request 0 (seq_len 3):  kv_indices = [ 7  8  9  0  0 ...]   key_mask = [1 1 1 0 0 ...]
    padding   (dummy row):  kv_indices = [ 0  0  0  0  0 ...]   key_mask = [1 0 0 0 0 ...]

and every layer writes the new K/V (``pool[out_cache_loc] = k, v``), gathers
``pool.index_select(kv_indices)`` (a dense [bs, kv_len] block) and runs ONE masked SDPA for the
batch: no loop, no host work, no shape that depends on the batch's contents. With grouped-query
attention (G query heads per KV head) the single query of a row lets each KV head's G queries
stand in SDPA's query dimension, so K and V are used as gathered, never copied per query head.

The same path serves two callers:

- eager (``init_forward_metadata``): kv_len is the batch's longest sequence, the metadata are
  fresh tensors; in a MIXED batch the leading decode rows take this path and the extend rows
  stage 4's per-request one. On a CPU the eager decode does not gather at all, because there the
  copy costs as much as the attention: it runs a fused C++ kernel that reads each key and value
  of a row once (decode_kernel.py), or, where no compiler can build it, reads the pool through the
  table with two library operations (table_attention.py).
- a CUDA graph (``init_forward_metadata_capture/replay_cuda_graph``): kv_len is the bucket's, the
  metadata are views of buffers allocated once (``init_cuda_graph_state``) and refilled in place
  before each replay, so the recorded kernels read the current batch. A padded row has seq_len 1
  and sees exactly one key, the dummy slot it just wrote: finite values, output thrown away.

Which path a pass takes is the batch's own ``forward_mode`` (DECODE, MIXED, EXTEND).

Extend rows (prefills, chunks of prompts) take stage 4's path, gather + one SDPA per request,
except on a CPU with the fused kernels: there a second C++ kernel (extend_kernel.cpp) attends
every extend row of the pass in one call, reading the pool in place through the table, causal
and flash-attention style. A 512-token chunk after 1024 cached tokens, one layer of SmolLM2-135M's
shape, 2 threads: 11.66 ms against 18.61 for the gather and SDPA (``tools/benchmark_extend.py``,
in a slow hour of the host; 1.6-4.3x over its chunks and prefixes).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from s00_foundation.forward_batch import ForwardBatch, ForwardMode, leading_decodes
from s04_paged_kv_pool.flash_backend import BLOCK_TABLE_PAGE_MULTIPLE, FlashAttentionBackend
from s04_paged_kv_pool.paged_backend import PagedAttentionBackend

from . import decode_kernel
from .table_attention import TableDecodeMetadata, table_attention

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # CPU machines, or CUDA without the optional extra
    flash_attn_with_kvcache = None


@dataclass
class DecodeMetadata:
    """The decode rows' metadata: fresh tensors (eager) or views of the graph buffers (a bucket)."""

    kv_indices: torch.Tensor  # [bs, kv_len] int64 pool slots, row i = request i's table row
    key_mask: torch.Tensor  # [bs, kv_len] bool, True where j < seq_lens[i]
    seq_lens: torch.Tensor  # [bs] int32, each decode row's length including its new token
    path: str = "gathered"  # how the rows attend: one of DECODE_PATHS
    table: TableDecodeMetadata | None = None  # the "table" path's index arrays, built at the pass's first layer


@dataclass
class ExtendMetadata:
    """A pass's extend rows, for the fused CPU kernel: which table rows, how many of each row's
    tokens are cached, how many are new (int64, on the CPU: the kernel reads them there)."""

    req_pool_indices: torch.Tensor  # [n]
    prefix_lens: torch.Tensor  # [n]
    extend_lens: torch.Tensor  # [n]

    @classmethod
    def of(cls, batch: ForwardBatch) -> "ExtendMetadata":
        lens = torch.tensor([batch.prefix_lens, batch.extend_lens])  # one small tensor from the lists
        return cls(batch.req_pool_indices.to(torch.int64), lens[0], lens[1])


# How decode rows attend: "gathered", one SDPA over the gathered [bs, kv_len] block (a GPU's eager
# decode, and what a CUDA graph replays); "table", through the table by two library operations
# (table_attention.py; a CPU without a compiler); "fused", the C++ kernel (decode_kernel.py; a CPU).
DECODE_PATHS = ("gathered", "table", "fused")


def eager_decode_path(pool: torch.Tensor) -> tuple[str, str]:
    """The fastest decode path for a pool buffer's device and dtype, and why: (path, reason)."""
    if pool.device.type != "cpu":
        return "gathered", "on a GPU the gather streams at its memory's speed"
    dtype = str(pool.dtype).removeprefix("torch.")
    kernel = decode_kernel.load() if pool.dtype in decode_kernel.POOL_DTYPES else None
    if kernel is not None and kernel.op is not None:
        return "fused", f"decode_kernel.cpp, built with {kernel.how}"
    why = f"no fused kernel: {kernel.how}" if kernel is not None else f"the fused kernel does not read {dtype}"
    if pool.dtype in (torch.float32, torch.float64):
        return "table", why
    return "gathered", f"{why} (and torch's sampled_addmm, the table's, has no {dtype} CPU kernel)"


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX, the tile units (Intel Xeon, 4th generation on) on which PyTorch's CPU
    kernels multiply bfloat16 matrices; False where torch cannot tell."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private, so asked for with care
    return bool(check()) if check is not None else False


def eager_extend_path(pool: torch.Tensor) -> tuple[str, str]:
    """How extend rows attend for a pool buffer's device and dtype, and why: ("fused", ...) on a
    CPU where the kernel is built, else ("per-request", ...), stage 4's gather + SDPA per request.

    The kernel reads a bfloat16 pool too (a block's keys and values widened to float32 as it goes,
    the arithmetic float32), and takes it except on a CPU with AMX: there PyTorch's SDPA (its CPU
    flash attention, whose products run in bfloat16 on the tile units) beat float32 arithmetic by
    1.6-2.5x wherever 128 or more new tokens met 512 or more keys. Without AMX its bfloat16 was
    no faster than its float32, and the kernel 2.3-3.5x faster than it (512 new tokens after 1024
    cached on the AMD EPYC host, all in bfloat16: 13.7 ms by SDPA, 4.7 by the kernel; the s08 lesson
    has the figures, ``tools/benchmark_extend.py --dtype bfloat16`` measures them here)."""
    if pool.device.type != "cpu":
        return "per-request", f"the fused extend kernel is a CPU one, the pool is on {pool.device.type}"
    if pool.dtype not in decode_kernel.POOL_DTYPES:
        dtype = str(pool.dtype).removeprefix("torch.")
        return "per-request", f"the pool is {dtype}; the extend kernel reads float32 and bfloat16"
    if pool.dtype == torch.bfloat16 and cpu_has_amx():
        return "per-request", "the pool is bfloat16 and this CPU has AMX, on which PyTorch's SDPA multiplies it faster"
    kernel = decode_kernel.load()
    if kernel.extend_op is not None:
        return "fused", f"extend_kernel.cpp, built with {kernel.how}"
    return "per-request", f"no fused kernel: {kernel.how}"


class DecodeAttentionBackend(PagedAttentionBackend):
    """One batched attention per layer for decodes; for extends stage 4's torch path, or on a CPU
    the fused extend kernel."""

    def __init__(self, req_to_token_pool, token_to_kv_pool):
        super().__init__(req_to_token_pool, token_to_kv_pool)
        # How eager decodes attend (a graph always replays "gathered"); tools/benchmark_decode.py
        # and the tests set it to compare the paths.
        self.decode_path, self.decode_path_reason = eager_decode_path(token_to_kv_pool.get_key_buffer(0))
        self.extend_path, self.extend_path_reason = eager_extend_path(token_to_kv_pool.get_key_buffer(0))
        self.extend_metadata: ExtendMetadata | None = None  # this pass's extend rows, for the fused path
        self.decode_metadata: DecodeMetadata | None = None  # this pass's decode rows (eager or a bucket)
        self.extend_batch: ForwardBatch | None = None  # a MIXED pass's extend rows, for stage 4's path
        self.bucket_metadata: dict[tuple[int, int], DecodeMetadata] = {}
        self.key_positions = torch.arange(
            req_to_token_pool.max_context_len, device=req_to_token_pool.req_to_token.device
        )

    # --- the metadata ---------------------------------------------------------------------------

    def fill_decode_metadata(self, meta: DecodeMetadata, req_pool_indices: torch.Tensor) -> None:
        """Fill ``meta.kv_indices`` and ``meta.key_mask`` in place for the requests in the table
        rows ``req_pool_indices``, whose lengths are already in ``meta.seq_lens``. Device work
        only (no .tolist(), no loop): it runs before every replay of a graph."""
        kv_len = meta.kv_indices.shape[1]
        # BEGIN EXERCISE: fill the static decode metadata in place (kv_indices and the key mask) [#what-you-write]
        table = self.req_to_token_pool.req_to_token
        meta.kv_indices.copy_(table[req_pool_indices, :kv_len])
        meta.key_mask.copy_(self.key_positions[None, :kv_len] < meta.seq_lens[:, None])
        # END EXERCISE

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eagerly, once per pass: decode metadata for the leading decode rows (kv_len = their
        longest sequence), stage 4's metadata for the extend rows of a MIXED or EXTEND batch."""
        mode = batch.forward_mode
        if mode is ForwardMode.EXTEND:
            self.decode_metadata = None
            return self.init_extend_metadata(batch)
        d = leading_decodes(batch.extend_lens)
        kv_len = max(batch.seq_lens[:d])
        device = batch.positions.device
        # A decode token sits at position seq_len - 1: the lengths come from the device, no copy.
        seq_lens = (batch.positions[:d] + 1).to(torch.int32)
        self.decode_metadata = DecodeMetadata(
            torch.empty((d, kv_len), dtype=torch.int64, device=device),
            torch.empty((d, kv_len), dtype=torch.bool, device=device),
            seq_lens,
            path=self.decode_path,
        )
        self.fill_decode_metadata(self.decode_metadata, batch.req_pool_indices[:d])
        self.extend_batch = None
        if mode is ForwardMode.MIXED:
            t = d  # the decode rows' tokens come first, one each
            # The extend rows as a batch of their own, kept here for the pass's layers. It names this
            # backend through a weak proxy: a batch kept by the backend it points at would be a cycle,
            # and a dropped engine's KV pool would wait for Python's cycle collector.
            self.extend_batch = replace(
                batch,
                attn_backend=weakref.proxy(self),
                input_ids=batch.input_ids[t:],
                positions=batch.positions[t:],
                extend_lens=batch.extend_lens[d:],
                seq_lens=batch.seq_lens[d:],
                req_pool_indices=batch.req_pool_indices[d:],
                out_cache_loc=batch.out_cache_loc[t:],
                forward_mode=ForwardMode.EXTEND,
            )
            self.init_extend_metadata(self.extend_batch)

    def init_extend_metadata(self, batch: ForwardBatch) -> None:
        """The extend rows' metadata: the fused kernel's three small arrays, or stage 4's."""
        self.extend_metadata = None
        if self.extend_path == "fused":
            self.extend_metadata = ExtendMetadata.of(batch)
        else:
            super().init_forward_metadata(batch)

    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        """Allocate the graphs' metadata buffers once, sized for the largest bucket (flat, so that
        every bucket's [bs, kv_len] view of them is contiguous)."""
        device = self.req_to_token_pool.req_to_token.device
        self.cuda_graph_kv_indices = torch.zeros(max_bs * max_kv_len, dtype=torch.int64, device=device)
        self.cuda_graph_key_mask = torch.zeros(max_bs * max_kv_len, dtype=torch.bool, device=device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, kv_len: int, seq_lens: torch.Tensor) -> None:
        """Give bucket (bs, kv_len) its views (``seq_lens``: the runner's static [bs] lengths);
        the graph captured next reads exactly these tensors."""
        n = bs * kv_len
        meta = DecodeMetadata(
            self.cuda_graph_kv_indices[:n].view(bs, kv_len), self.cuda_graph_key_mask[:n].view(bs, kv_len), seq_lens
        )
        self.bucket_metadata[bs, kv_len] = meta

    def init_forward_metadata_replay_cuda_graph(self, bs: int, kv_len: int, req_pool_indices: torch.Tensor) -> None:
        """Refill bucket (bs, kv_len)'s views for the batch now in the runner's static buffers."""
        if len(req_pool_indices) != bs:
            raise ValueError(
                f"bucket ({bs}, {kv_len}) has {bs} rows, padding included, but {len(req_pool_indices)} table rows "
                "came: pass the static buffer's first bs rows (req_pool_indices[:bs]), not the batch's own"
            )
        meta = self.bucket_metadata[bs, kv_len]
        self.fill_decode_metadata(meta, req_pool_indices)
        self.decode_metadata, self.extend_batch = meta, None

    # --- the forward pass -----------------------------------------------------------------------

    def forward(self, q, k, v, layer_id, batch):
        mode = batch.forward_mode
        if mode is ForwardMode.EXTEND:
            return self.forward_extend(q, k, v, layer_id, batch)
        meta = self.decode_metadata
        if meta is None:
            raise RuntimeError(
                f"a {mode.value} batch but no decode metadata: call init_forward_metadata(batch) before model(batch)"
            )
        d = meta.kv_indices.shape[0]
        decoded = self.forward_decode(q[:d], k[:d], v[:d], layer_id, batch.out_cache_loc[:d], meta)
        if mode is ForwardMode.DECODE:
            return decoded
        extended = self.forward_extend(q[d:], k[d:], v[d:], layer_id, self.extend_batch)
        return torch.cat([decoded, extended])

    def forward_extend(self, q, k, v, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Extend rows: write their K/V, then one call of the fused kernel for all of them, or
        stage 4's path (gather + SDPA per request)."""
        meta = self.extend_metadata
        if meta is None:
            return super().forward(q, k, v, layer_id, batch)
        pool = self.token_to_kv_pool
        pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
        kernel = decode_kernel.load().extend_op
        assert kernel is not None, "the fused extend path is chosen only when its kernel loaded"
        return kernel(
            q.contiguous(),
            pool.get_key_buffer(layer_id),
            pool.get_value_buffer(layer_id),
            self.req_to_token_pool.req_to_token,
            meta.req_pool_indices,
            meta.prefix_lens,
            meta.extend_lens,
            q.shape[-1] ** -0.5,
        )

    def forward_decode(self, q, k, v, layer_id: int, out_cache_loc: torch.Tensor, meta: DecodeMetadata) -> torch.Tensor:
        """One new token per row: q [bs, H, D], k, v [bs, KVH, D] -> [bs, H, D]: write the new K/V,
        then attend by ``meta.path``: over the gathered block (``attend_decode``), by the fused
        kernel (decode_kernel.py: it reads each row's first seq_len slots of ``kv_indices``), or
        through the table (table_attention.py; its index arrays are built at the first layer,
        where the query brings the head count, and every later layer reuses them)."""
        pool = self.token_to_kv_pool
        pool.set_kv_buffer(layer_id, out_cache_loc, k, v)
        if meta.path == "gathered":
            return self.attend_decode(q, layer_id, meta.kv_indices, meta.key_mask)
        k_buffer, v_buffer = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        if meta.path == "fused":
            kernel = decode_kernel.load().op
            assert kernel is not None, "the fused path is chosen only when its kernel loaded"
            # q of the model's dtype (the pool's) as it is: the output comes back in it, rounded once
            return kernel(q.contiguous(), k_buffer, v_buffer, meta.kv_indices, meta.seq_lens, q.shape[-1] ** -0.5)
        if meta.path != "table":
            raise ValueError(f"decode path {meta.path!r}: expected one of {DECODE_PATHS}")
        if meta.table is None:
            meta.table = TableDecodeMetadata.build(
                meta.kv_indices, meta.key_mask, q.shape[1], k.shape[1], num_slots=k_buffer.shape[0]
            )
        return table_attention(q, k_buffer, v_buffer, meta.table)

    def attend_decode(self, q, layer_id: int, kv_indices: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """Attention of one new token per row over its keys: q [n, H, D], kv_indices / key_mask
        [n, kv_len] -> [n, H, D], in one SDPA call."""
        pool = self.token_to_kv_pool
        n, kv_len = kv_indices.shape
        # BEGIN EXERCISE: decode attention for every row in one batched call [#what-you-write]
        flat = kv_indices.reshape(-1)
        k_buffer, v_buffer = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        kv_heads, head_dim = k_buffer.shape[1:]
        keys = k_buffer.index_select(0, flat).view(n, kv_len, kv_heads, head_dim).transpose(1, 2)
        values = v_buffer.index_select(0, flat).view(n, kv_len, kv_heads, head_dim).transpose(1, 2)
        # One query per row, so the G query heads of each KV head can stand in the query dimension
        # (query head h reads KV head h // G): every head count matches, and K and V are read as
        # they are, never copied once per query head (as SDPA's enable_gqa does on its math kernel).
        grouped = q.reshape(n, kv_heads, q.shape[1] // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=key_mask[:, None, None, :])
        return out.reshape(n, -1, head_dim)
        # END EXERCISE


class DecodeFlashAttentionBackend(DecodeAttentionBackend, FlashAttentionBackend):
    """flash-attn everywhere (stage 4's varlen kernel for extends), and ``flash_attn_with_kvcache``
    for decodes: it takes per-row lengths (``cache_seqlens``), so padded keys cost no math.

    flash-attn 2 reads a paged cache through a block table only in pages of 256 slots or more
    (stage 4's flash_backend.py says why). With such pages the kernel reads the pool in place;
    with smaller ones (1 by default) the decode gathers a dense [bs, kv_len] copy first, as the
    torch path does, and the kernel stops at each row's length.
    """

    def __init__(self, req_to_token_pool, token_to_kv_pool):
        if flash_attn_with_kvcache is None:
            raise RuntimeError(
                'flash_attn is not importable; install it with pip install -e ".[flash]" or use the torch backend'
            )
        super().__init__(req_to_token_pool, token_to_kv_pool)
        self.paged = token_to_kv_pool.page_size % BLOCK_TABLE_PAGE_MULTIPLE == 0

    def block_table(self, meta: DecodeMetadata) -> torch.Tensor:
        """The page ids of each row's first kv_len positions: the slot of every page's first
        position, divided by the page size (a [bs, pages] view, no copy of the pool)."""
        p = self.token_to_kv_pool.page_size
        return (meta.kv_indices[:, ::p] // p).to(torch.int32)

    def forward_decode(self, q, k, v, layer_id, out_cache_loc, meta):
        pool = self.token_to_kv_pool
        pool.set_kv_buffer(layer_id, out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        if self.paged:
            p = pool.page_size
            keys = k_buffer.view(-1, p, *k_buffer.shape[1:])  # [num_pages + 1, page_size, KVH, D]
            values = v_buffer.view(-1, p, *v_buffer.shape[1:])
            extra = {"block_table": self.block_table(meta)}
        else:
            bs, kv_len = meta.kv_indices.shape
            flat = meta.kv_indices.view(-1)
            keys = k_buffer.index_select(0, flat).view(bs, kv_len, *k_buffer.shape[1:])
            values = v_buffer.index_select(0, flat).view(bs, kv_len, *v_buffer.shape[1:])
            extra = {}
        out = flash_attn_with_kvcache(
            q[:, None].contiguous(), keys, values, cache_seqlens=meta.seq_lens, causal=True, **extra
        )
        return out[:, 0]
