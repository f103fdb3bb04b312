"""Decode attention on a CPU that reads K and V through the table, with no copy of them.

The batched decode (decode_attention.py) gathers every row's keys and values into a dense
``[bs, kv_len]`` block and runs one SDPA over it. On a GPU that copy streams at terabytes a
second; on a CPU it costs about as much as the attention itself: every key is read from the pool,
written into the block, and read again by SDPA. So on a CPU the decode reads the pool where it
is, in two library operations that follow index arrays themselves::

    scores = Q K^T only where the table points     torch.sparse.sampled_addmm (SDDMM)
    out    = sum_j p_j V[slot_j]                   F.embedding_bag, mode="sum", per_sample_weights=p

Both work on the pool viewed as one long matrix of head rows, ``[num_slots * KVH, D]``: row
``slot * KVH + g`` is the K (or V) of KV head ``g`` of the token in ``slot``. Query head ``h`` of
request ``i`` is row ``i * H + h`` of ``q`` viewed as ``[bs * H, D]``, and it attends to the
``kv_len`` head rows ``kv_indices[i, j] * KVH + h // G`` (G query heads share one KV head: GQA)::

    columns [bs * H * kv_len]   (row i*H + h lists its kv_len head rows; past seq_len, whatever its table row holds)
    pattern  a sparse CSR matrix [bs * H, num_slots * KVH] with those columns, kv_len per row

    scores = sampled_addmm(bias, q, K_pool^T)        scale * q.k + bias at each (row, column): [bs*H, kv_len]
    p      = softmax(scores)                         bias: 0 for a key of the row, -inf for padding
    out    = embedding_bag(columns, V_pool, offsets, per_sample_weights=p)   [bs * H, D]

``sampled_addmm(input, a, b, beta, alpha)`` (a "sampled dense-dense matrix product") computes
``alpha * (a @ b) + beta * input`` only at the entries of the sparse ``input``: exactly the
query-key pairs attention needs, with the mask added on the way (the pattern's values are the
bias, ``beta=1``). An embedding bag sums the rows of a matrix that a list of indices names, each
times its weight: exactly the attention-weighted sum of values. Neither writes the gathered K or
V anywhere. The index arrays depend only on the batch, not on the layer: they are built once per
pass (``build``) and every layer reuses them with its own pool buffers. A padding entry (a key
past its row's length) is read with weight exactly 0, so any finite value there changes nothing.

It is the CPU's decode where the fused kernel (decode_kernel.py) cannot be built, and the
library-only version of the same idea. Measured on this course's CPU (2 cores, 2 torch threads;
one decode step of SmolLM2-135M's shape, ``tools/benchmark_decode.py --shape smollm2 --threads 2``,
in a busy hour of the shared host; the lesson has the whole table):

    requests x keys     one SDPA over the gathered block    through the table    fused kernel    bare pass
    32 x 128                      122.7 ms                      116.4 ms           105.0 ms        89.2 ms
    64 x 512                      413.5 ms                      273.4 ms           239.3 ms       134.2 ms
    64 x 1024                     693.3 ms                      403.9 ms           352.1 ms       128.0 ms

with the same tokens. The table path stays 1.1-1.4x above the memory floor (every key and value
read once): the scores pass reads each key once per query head, and every row is padded to the
batch's longest, where the fused kernel scores the G query heads of a KV head with one read of
its keys and stops at each row's length.

A GPU keeps the dense block: there its copy is cheap, SDPA and flash-attn are fast on it, and a
CUDA graph records it as it is (step 2 of the lesson).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# torch marks its sparse CSR tensors "beta" with a UserWarning on first use; the two operations used
# here are stable and tested (tests/stage08), so the notice would only confuse a learner's output.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)


@dataclass
class TableDecodeMetadata:
    """A decode pass's index arrays for attention through the table (built once, read by every layer)."""

    pattern: torch.Tensor  # sparse CSR [bs * H, num_slots * KVH]: row i*H + h has kv_len columns, the
    #                        bias as values (0 for a key of the row, -inf for padding past its seq_len)
    columns: torch.Tensor  # [bs * H * kv_len] int32 head rows of the pool (the pattern's column indices)
    offsets: torch.Tensor  # [bs * H] int32: where each row's columns start (row * kv_len)

    @classmethod
    def build(
        cls, kv_indices: torch.Tensor, key_mask: torch.Tensor, num_heads: int, num_kv_heads: int, num_slots: int
    ) -> "TableDecodeMetadata":
        """From the decode metadata's ``kv_indices`` and ``key_mask`` [bs, kv_len] (decode_attention.py)."""
        bs, kv_len = kv_indices.shape
        rows = bs * num_heads
        kv_head = torch.arange(num_heads, device=kv_indices.device) // (num_heads // num_kv_heads)
        columns = (kv_indices[:, None, :] * num_kv_heads + kv_head[None, :, None]).reshape(-1).to(torch.int32)
        crow = torch.arange(0, rows * kv_len + 1, kv_len, dtype=torch.int32, device=kv_indices.device)
        bias = torch.zeros(bs, kv_len, device=kv_indices.device).masked_fill_(~key_mask, float("-inf"))
        pattern = torch.sparse_csr_tensor(
            crow,
            columns,
            bias[:, None, :].expand(bs, num_heads, kv_len).reshape(-1),
            size=(rows, num_slots * num_kv_heads),
            check_invariants=False,
        )
        return cls(pattern, columns, crow[:-1])


def table_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, table: TableDecodeMetadata
) -> torch.Tensor:
    """One new token per row: q [bs, H, D] against one layer's pool buffers [num_slots, KVH, D],
    through ``table`` -> [bs, H, D]."""
    bs, num_heads, head_dim = q.shape
    scores = torch.sparse.sampled_addmm(
        table.pattern,
        q.reshape(bs * num_heads, head_dim),
        k_buffer.view(-1, head_dim).t(),
        beta=1.0,
        alpha=head_dim**-0.5,
    )
    probs = torch.softmax(scores.values().view(bs * num_heads, -1), dim=-1)
    out = F.embedding_bag(
        table.columns, v_buffer.view(-1, head_dim), table.offsets, mode="sum", per_sample_weights=probs.view(-1)
    )
    return out.view(bs, num_heads, head_dim)
