"""Attention a CUDA graph can replay: a decode path that reads only static tensors.

Stage 4's backends prepare each pass on the host: ``.tolist()`` of the table rows, a Python loop
over the requests, index arrays whose length is the sum of the batch's sequence lengths. A
captured graph records none of that host work, and it fixes every shape it saw. So a replayed
decode needs its metadata in tensors that (1) exist before the capture, (2) keep their shapes
and addresses, and (3) are refilled, on the device, before each replay::

    static metadata of one bucket (bs requests, keys padded to kv_len)

    kv_indices [bs, kv_len]   kv_indices[i, j] = req_to_token[req_pool_indices[i], j]
    key_mask   [bs, kv_len]   key_mask[i, j]   = j < seq_lens[i]
    seq_lens   [bs] int32     (the flash-attn kernel takes lengths instead of a mask)

    request 0 (seq_len 3):  kv_indices = [ 7  8  9  0  0 ...]   key_mask = [1 1 1 0 0 ...]
    padding   (dummy row):  kv_indices = [ 0  0  0  0  0 ...]   key_mask = [1 0 0 0 0 ...]

A decode layer then writes the new K/V (``pool[out_cache_loc] = k, v``), gathers
``pool[kv_indices]`` (a dense [bs, kv_len] block) and runs one masked SDPA call for the whole
batch: no loop, no shape that depends on the batch's contents. A padded row has seq_len 1 and
sees exactly one key, the dummy slot it just wrote: finite values, output thrown away.

The metadata of every bucket are views into one set of buffers sized for the largest bucket,
allocated by ``init_cuda_graph_state``. ``init_forward_metadata_capture_cuda_graph`` hands a
bucket its views (SGLang's name); ``init_forward_metadata_replay_cuda_graph`` refills them for
the current batch. Prefill and any batch the graphs do not cover still go through stage 4's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from s00_foundation.forward_batch import ForwardBatch
from s04_paged_kv_pool.allocator import pages_for
from s04_paged_kv_pool.flash_backend import BLOCK_TABLE_PAGE_MULTIPLE, FlashAttentionBackend
from s04_paged_kv_pool.paged_backend import PagedAttentionBackend

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # CPU machines, or CUDA without the optional extra
    flash_attn_with_kvcache = None


@dataclass
class GraphDecodeMetadata:
    """One bucket's static metadata: views of the backend's buffers, refilled before each replay."""

    batch: ForwardBatch  # the bucket's static batch (the one the graph was captured with)
    kv_indices: torch.Tensor  # [bs, kv_len] int64 pool slots, row i = request i's table row
    key_mask: torch.Tensor  # [bs, kv_len] bool, True where j < seq_lens[i]
    seq_lens: torch.Tensor  # [bs] int32 view of the runner's static seq_lens


class GraphAttentionBackend(PagedAttentionBackend):
    """Stage 4's torch backend for everything, plus a graph-friendly decode (gather + masked SDPA)."""

    def __init__(self, req_to_token_pool, token_to_kv_pool):
        super().__init__(req_to_token_pool, token_to_kv_pool)
        self.graph_metadata: GraphDecodeMetadata | None = None  # the bucket being captured or replayed
        self.bucket_metadata: dict[tuple[int, int], GraphDecodeMetadata] = {}

    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        """Allocate the static metadata buffers once, sized for the largest bucket."""
        device = self.req_to_token_pool.req_to_token.device
        self.cuda_graph_kv_indices = torch.zeros((max_bs, max_kv_len), dtype=torch.int64, device=device)
        self.cuda_graph_key_mask = torch.zeros((max_bs, max_kv_len), dtype=torch.bool, device=device)
        self.cuda_graph_key_positions = torch.arange(max_kv_len, device=device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, kv_len: int, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        """Give bucket (bs, kv_len) its views; the graph captured next reads exactly these tensors."""
        meta = GraphDecodeMetadata(
            batch, self.cuda_graph_kv_indices[:bs, :kv_len], self.cuda_graph_key_mask[:bs, :kv_len], seq_lens
        )
        self.bucket_metadata[bs, kv_len] = meta
        self.graph_metadata = meta

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, kv_len: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Refill bucket (bs, kv_len)'s views for the batch now in the runner's static buffers.

        Device work only (no .tolist(), no loop over requests): it runs before every replay.
        """
        meta = self.bucket_metadata[bs, kv_len]
        raise NotImplementedError("Stage 8: fill meta.kv_indices with the first kv_len slots of each request's table row (req_to_token[req_pool_indices]) and meta.key_mask with \"key position < seq_len\" (self.cuda_graph_key_positions), in place (copy_), then make meta the current self.graph_metadata - see stages/s08_cuda_graph/README.md")

    def forward(self, q, k, v, layer_id, batch):
        meta = self.graph_metadata
        if meta is not None and meta.batch is batch:
            return self.forward_decode_graph(q, k, v, layer_id, meta)
        return super().forward(q, k, v, layer_id, batch)  # stage 4's path: prefill, mixed, eager decode

    def forward_decode_graph(self, q, k, v, layer_id: int, meta: GraphDecodeMetadata) -> torch.Tensor:
        """One decode token per row; q [bs, H, D], k, v [bs, KVH, D] -> [bs, H, D]."""
        pool = self.token_to_kv_pool
        raise NotImplementedError("Stage 8: write k, v at meta.batch.out_cache_loc (set_kv_buffer), gather this layer's K and V at meta.kv_indices ([bs, kv_len, KVH, D]), then one SDPA call for the whole batch: queries [bs, H, 1, D], keys/values [bs, KVH, kv_len, D], attn_mask from meta.key_mask, enable_gqa=True - see stages/s08_cuda_graph/README.md")


class GraphFlashAttentionBackend(GraphAttentionBackend, FlashAttentionBackend):
    """flash-attn everywhere (stage 4's varlen kernel for prefill), and ``flash_attn_with_kvcache``
    for the graph decode: it takes per-row lengths (``cache_seqlens``), so padded keys cost no math.

    flash-attn 2 reads a paged cache through a block table only in pages of 256 slots or more
    (stage 4's flash_backend.py says why). With such pages the kernel reads the pool in place;
    with smaller ones (1 by default) the graph gathers a dense [bs, kv_len] copy first, as the
    torch path does, and the kernel stops at each row's length.
    """

    def __init__(self, req_to_token_pool, token_to_kv_pool):
        if flash_attn_with_kvcache is None:
            raise RuntimeError('flash_attn is not importable; install it with pip install -e ".[flash]" or use the torch backend')
        super().__init__(req_to_token_pool, token_to_kv_pool)
        self.paged = token_to_kv_pool.page_size % BLOCK_TABLE_PAGE_MULTIPLE == 0
        self.bucket_block_tables: dict[tuple[int, int], torch.Tensor] = {}

    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        super().init_cuda_graph_state(max_bs, max_kv_len)
        p = self.token_to_kv_pool.page_size
        device = self.req_to_token_pool.req_to_token.device
        self.cuda_graph_block_table = torch.zeros((max_bs, pages_for(max_kv_len, p)), dtype=torch.int32, device=device)

    def init_forward_metadata_capture_cuda_graph(self, bs, kv_len, batch, seq_lens) -> None:
        super().init_forward_metadata_capture_cuda_graph(bs, kv_len, batch, seq_lens)
        p = self.token_to_kv_pool.page_size
        self.bucket_block_tables[bs, kv_len] = self.cuda_graph_block_table[:bs, : pages_for(kv_len, p)]

    def init_forward_metadata_replay_cuda_graph(self, bs, kv_len, req_pool_indices, seq_lens) -> None:
        super().init_forward_metadata_replay_cuda_graph(bs, kv_len, req_pool_indices, seq_lens)
        if self.paged:
            # The slot of each page's first position, divided by the page size, is the page id.
            p = self.token_to_kv_pool.page_size
            table = self.req_to_token_pool.req_to_token
            self.bucket_block_tables[bs, kv_len].copy_(table[req_pool_indices, :kv_len:p] // p)

    def forward_decode_graph(self, q, k, v, layer_id, meta):
        pool = self.token_to_kv_pool
        pool.set_kv_buffer(layer_id, meta.batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        bs, kv_len = meta.kv_indices.shape
        if self.paged:
            p = pool.page_size
            keys = k_buffer.view(-1, p, *k_buffer.shape[1:])  # [num_pages + 1, page_size, KVH, D]
            values = v_buffer.view(-1, p, *v_buffer.shape[1:])
            extra = {"block_table": self.bucket_block_tables[bs, kv_len]}
        else:
            keys, values, extra = k_buffer[meta.kv_indices], v_buffer[meta.kv_indices], {}
        out = flash_attn_with_kvcache(q[:, None].contiguous(), keys, values, cache_seqlens=meta.seq_lens, causal=True, **extra)
        return out[:, 0]
