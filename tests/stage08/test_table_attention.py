"""Stage 8 (graded): reading K/V through the table (a CPU's decode where the fused kernel cannot be
built) computes what the gathered block computes.

The table path (table_attention.py) is provided; these tests hold it to your code: its output
equals your ``attend_decode`` on the same metadata (GQA of several group sizes, rows of very
different lengths, a padding row at the dummy slot) and it reads no slot outside a row's table.
test_decode_kernel.py runs the engine's CPU decode through it against stage 4's logits."""

from __future__ import annotations

import pytest
import torch

from graph_helpers import backend_with_rows
from s08_cuda_graph.table_attention import TableDecodeMetadata, table_attention

HEAD_DIM = 16


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_table_attention_equals_your_gathered_decode(num_heads, num_kv_heads):
    lengths = [37, 1, 0, 12, 64, 5]  # row 2: a padding row (the dummy slot only)
    backend, meta = backend_with_rows(num_kv_heads, lengths)
    q = torch.randn(len(lengths), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    expected = backend.attend_decode(q, 0, meta.kv_indices, meta.key_mask)
    pool = backend.token_to_kv_pool
    table = TableDecodeMetadata.build(meta.kv_indices, meta.key_mask, num_heads, num_kv_heads, pool.num_slots)
    got = table_attention(q, pool.get_key_buffer(0), pool.get_value_buffer(0), table)
    assert got.shape == expected.shape
    worst = (got - expected).abs().max().item()
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (
        f"{num_heads} query heads over {num_kv_heads} KV heads, rows of {lengths} tokens: the table path and your "
        f"attend_decode differ by up to {worst:.3g} (fill_decode_metadata's tables were checked first; check "
        "attend_decode: one masked attention over each row's gathered keys, query head h reading KV head h // G)"
    )


def test_table_attention_reads_only_each_rows_slots():
    lengths = [9, 20, 3]
    backend, meta = backend_with_rows(2, lengths)
    pool = backend.token_to_kv_pool
    q = torch.randn(len(lengths), 4, HEAD_DIM)
    table = TableDecodeMetadata.build(meta.kv_indices, meta.key_mask, 4, 2, pool.num_slots)
    before = table_attention(q, pool.get_key_buffer(0), pool.get_value_buffer(0), table)
    used = set(meta.kv_indices[meta.key_mask].tolist())
    others = torch.tensor(sorted(set(range(pool.num_slots)) - used))
    pool.k_buffer[0][others] = 1e4  # every slot no row may see (a padding key's weight is exactly 0)
    pool.v_buffer[0][others] = -1e4
    after = table_attention(q, pool.get_key_buffer(0), pool.get_value_buffer(0), table)
    assert torch.equal(before, after), "a row's output changed when slots outside its table did"
