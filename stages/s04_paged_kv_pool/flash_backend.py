"""``FlashAttentionBackend``: the paged backend with flash-attn's varlen kernel (CUDA only).

One kernel call per layer handles the whole ragged batch (``cu_seqlens`` = our indptr arrays;
with ``causal=True`` and more keys than queries, flash-attn aligns the mask bottom-right,
which is exactly "the new tokens come after the cached prefix").

Where K/V come from depends on the page size:

- page_size a multiple of 256: the kernel reads the pool directly through a block table
  (block_table[i, j] = the page holding request i's positions j*page_size...), no copy at all.
  flash-attn 2 only accepts paged K/V in pages whose size is a multiple of 256.
- any other page size (1 by default): the same gather as the PyTorch backend (kv_indices),
  then the varlen kernel over the gathered copy.

flash-attn is optional: ``pip install -e ".[flash]"``. Without it, or on a CPU, ModelRunner
picks ``PagedAttentionBackend``.
"""

from __future__ import annotations

import torch

from .allocator import pages_for
from .paged_backend import ForwardMetadata, PagedAttentionBackend

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # not installed: CPU machines, or CUDA without the optional extra
    flash_attn_varlen_func = None

BLOCK_TABLE_PAGE_MULTIPLE = 256  # flash-attn 2 refuses paged K/V in pages of any other size


def flash_attn_available() -> bool:
    return flash_attn_varlen_func is not None


class FlashAttentionBackend(PagedAttentionBackend):
    def __init__(self, req_to_token_pool, token_to_kv_pool):
        if flash_attn_varlen_func is None:
            raise RuntimeError(
                'flash_attn is not importable; install it with pip install -e ".[flash]" or use the torch backend'
            )
        super().__init__(req_to_token_pool, token_to_kv_pool)
        self.block_table: torch.Tensor | None = None
        self.max_extend_len = self.max_seq_len = 0

    def init_forward_metadata(self, batch) -> None:
        super().init_forward_metadata(batch)
        # Python ints, computed once per pass: reading them off a GPU tensor in every layer would sync.
        self.max_extend_len, self.max_seq_len = max(batch.extend_lens), max(batch.seq_lens)
        p = self.token_to_kv_pool.page_size
        self.block_table = None
        if p % BLOCK_TABLE_PAGE_MULTIPLE == 0:
            # Position j of a request sits at offset j % p of the page holding its position
            # j - j % p; the slot of every page's first position, divided by p, is the page id.
            # Entries past a request's length are stale but never read (cu_seqlens_k bounds them).
            num_pages = pages_for(self.max_seq_len, p)
            rows = batch.req_pool_indices
            self.block_table = (self.req_to_token_pool.req_to_token[rows, : num_pages * p : p] // p).to(torch.int32)

    def forward(self, q, k, v, layer_id, batch):
        meta: ForwardMetadata = self.metadata_for(batch)
        pool = self.token_to_kv_pool
        pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        if self.block_table is not None:
            p = pool.page_size
            keys = k_buffer.view(-1, p, *k_buffer.shape[1:])  # [num_pages + 1, page_size, kv_heads, head_dim]
            values = v_buffer.view(-1, p, *v_buffer.shape[1:])
            extra = {"block_table": self.block_table}
        else:
            keys, values, extra = k_buffer[meta.kv_indices], v_buffer[meta.kv_indices], {}
        return flash_attn_varlen_func(
            q.contiguous(),
            keys,
            values,
            cu_seqlens_q=meta.qo_indptr,
            cu_seqlens_k=meta.kv_indptr,
            max_seqlen_q=self.max_extend_len,
            max_seqlen_k=self.max_seq_len,
            causal=True,
            **extra,
        )
