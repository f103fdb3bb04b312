"""``PagedAttentionBackend``: attention whose K/V live in the shared pool, found through the
request -> slots table.

Once per forward pass, ``init_forward_metadata`` turns the batch into flat index arrays (the
layout SGLang's triton and FlashInfer backends use)::

    qo_indptr   [num_reqs + 1]   request i's new tokens are rows qo_indptr[i]:qo_indptr[i+1] of q
    kv_indptr   [num_reqs + 1]   request i's K/V slots are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices  [sum(seq_lens)]  req_to_token[row_i, 0:seq_len_i] for every request, concatenated

Then per layer ``forward``

    1. writes the new tokens' k, v into their slots: pool[out_cache_loc[t]] = k[t], v[t]
    2. gathers every request's K/V from the pool with kv_indices (a copy, [sum(seq_lens), ...];
       ``index_select`` on the pool's first dimension: a plain row copy, ~10x faster on a CPU
       than the general advanced indexing ``pool[kv_indices]``, which computes the same)
    3. runs causal attention per request: its new queries over its gathered prefix + new keys.

A request with prefix_len = 0 is a prefill, extend_len = 1 a decode, anything between an
extend after a cached prefix (stage 6 reuses prefixes, stage 7 splits long prompts): one
ragged batch may mix all three. The backend never looks at a request's history; it only
follows the table, which is what lets any slot hold any token.
"""

from __future__ import annotations

import weakref
from dataclasses import InitVar, dataclass, field

import torch

from s00_foundation.attention import AttentionBackend, causal_attention
from s00_foundation.forward_batch import ForwardBatch

from .memory_pool import ReqToTokenPool, TokenToKVPool


@dataclass
class ForwardMetadata:
    batch: InitVar[ForwardBatch]  # the batch these indices were computed for (``is_for``)
    qo_indptr: torch.Tensor  # [num_reqs + 1] int32
    kv_indptr: torch.Tensor  # [num_reqs + 1] int32
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64 pool slots
    # A weak reference: the backend keeps its metadata and the batch points at the backend, so a
    # strong one would be a cycle, and a dropped engine's KV pool (GiBs) would stay in memory until
    # Python's cycle collector happened to run.
    batch_ref: weakref.ref = field(init=False, repr=False)

    def __post_init__(self, batch: ForwardBatch):
        self.batch_ref = weakref.ref(batch)
        # Wrong running offsets or indices would make attention read another request's K/V: say so here.
        check_indptr("qo_indptr", self.qo_indptr, batch.extend_lens, "extend_lens")
        check_indptr("kv_indptr", self.kv_indptr, batch.seq_lens, "seq_lens")
        if len(self.kv_indices) != sum(batch.seq_lens):
            raise ValueError(
                f"kv_indices must hold sum(seq_lens) = {sum(batch.seq_lens)} slots, each request's table row "
                f"up to its seq_len (seq_lens = {batch.seq_lens}); got {len(self.kv_indices)}"
            )

    def is_for(self, batch: ForwardBatch) -> bool:
        return self.batch_ref() is batch


def check_indptr(name: str, indptr: torch.Tensor, lens: list[int], lens_name: str) -> None:
    """An indptr array must be the running sum of the lengths, starting at 0: [0, l0, l0+l1, ...]."""
    expected = [0]
    for n in lens:
        expected.append(expected[-1] + n)
    got = indptr.tolist()
    if indptr.dtype != torch.int32 or got != expected:
        raise ValueError(
            f"{name} must be the running sum of {lens_name} starting at 0, as int32 ({lens_name} = {lens} -> "
            f"{name} = {expected}); got {got} ({indptr.dtype})"
        )


class PagedAttentionBackend(AttentionBackend):
    """Plain PyTorch: a gather through the table, then SDPA per request. Runs on any device."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.forward_metadata: ForwardMetadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Compute the batch's index arrays once, before the model runs its layers."""
        if batch.req_pool_indices is None or batch.out_cache_loc is None:
            raise ValueError("a paged forward batch needs req_pool_indices and out_cache_loc")
        if len(batch.out_cache_loc) != len(batch.input_ids):
            raise ValueError(
                f"out_cache_loc has {len(batch.out_cache_loc)} slots for {len(batch.input_ids)} new tokens"
            )
        device = batch.input_ids.device
        rows = batch.req_pool_indices.tolist()
        # BEGIN EXERCISE: the batch's qo_indptr, kv_indptr and kv_indices [#what-you-write]
        qo_indptr = torch.tensor([0, *batch.extend_lens], device=device).cumsum(0).to(torch.int32)
        kv_indptr = torch.tensor([0, *batch.seq_lens], device=device).cumsum(0).to(torch.int32)
        table = self.req_to_token_pool.req_to_token
        kv_indices = torch.cat([table[row, :seq_len] for row, seq_len in zip(rows, batch.seq_lens)])
        self.forward_metadata = ForwardMetadata(batch, qo_indptr, kv_indptr, kv_indices)  # checks the indptrs
        # END EXERCISE

    def metadata_for(self, batch: ForwardBatch) -> ForwardMetadata:
        if self.forward_metadata is None or not self.forward_metadata.is_for(batch):
            raise RuntimeError(
                "the paged backend has no metadata for this batch: call attn_backend.init_forward_metadata(batch) "
                "before model(batch) (ModelRunner.forward does it)"
            )
        return self.forward_metadata

    def forward(self, q, k, v, layer_id, batch):
        meta = self.metadata_for(batch)
        pool = self.token_to_kv_pool
        # BEGIN EXERCISE: write the new K/V into the pool, then attend each request over its own K/V [#what-you-write]
        pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
        keys = pool.get_key_buffer(layer_id).index_select(0, meta.kv_indices)
        values = pool.get_value_buffer(layer_id).index_select(0, meta.kv_indices)
        outputs, q_start, kv_start = [], 0, 0
        for extend_len, seq_len in zip(batch.extend_lens, batch.seq_lens):
            outputs.append(
                causal_attention(
                    q[q_start : q_start + extend_len],
                    keys[kv_start : kv_start + seq_len],
                    values[kv_start : kv_start + seq_len],
                )
            )
            q_start, kv_start = q_start + extend_len, kv_start + seq_len
        return torch.cat(outputs, dim=0)
        # END EXERCISE
