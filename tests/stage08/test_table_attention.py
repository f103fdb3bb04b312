"""Stage 8 (graded): a CPU's eager decode reads K/V through the table and computes what the
gathered block computes.

The table path (table_attention.py) is provided; these tests hold it to your code: its output
equals your ``attend_decode`` on the same metadata (GQA of several group sizes, rows of very
different lengths, a padding row at the dummy slot), it reads no slot outside a row's table, and
the engine's CPU decode through it gives stage 4's logits for every family, in DECODE and MIXED
passes."""

from __future__ import annotations

import pytest
import torch

from graph_helpers import MAX_CONTEXT, POOL_SIZE, prompts_of, run_pass, start
from reference import engine_model
from s00_foundation.forward_batch import ForwardMode
from s04_paged_kv_pool.memory_pool import ReqToTokenPool, TokenToKVPool
from s04_paged_kv_pool.model_runner import ModelRunner
from s08_cuda_graph.decode_attention import DecodeAttentionBackend, DecodeMetadata
from s08_cuda_graph.model_runner import GraphModelRunner
from s08_cuda_graph.table_attention import TableDecodeMetadata, table_attention

HEAD_DIM = 16


def backend_with_rows(num_kv_heads: int, lengths: list[int], seed: int = 0):
    """A backend over a random pool whose table rows hold ``lengths`` tokens in scattered slots
    (a length-0 entry is a padding row: the dummy row of slot 0, seq_len 1)."""
    generator = torch.Generator().manual_seed(seed)
    num_slots = 1 + sum(lengths) + 7
    kv = TokenToKVPool(num_slots - 1, 1, num_layers=1, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM)
    kv.k_buffer[0].copy_(torch.randn(kv.k_buffer[0].shape, generator=generator))
    kv.v_buffer[0].copy_(torch.randn(kv.v_buffer[0].shape, generator=generator))
    table = ReqToTokenPool(len(lengths), max(lengths) + 3)
    slots = (torch.randperm(num_slots - 1, generator=generator) + 1).tolist()  # never slot 0
    for row, n in enumerate(lengths):
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
    backend.fill_decode_metadata(meta, torch.arange(len(lengths)))
    return backend, meta


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
        f"attend_decode differ by up to {worst:.3g} (check fill_decode_metadata: kv_indices and key_mask)"
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


def test_cpu_eager_decode_goes_through_the_table_and_equals_stage4(tiny_model_dir):
    model = engine_model(str(tiny_model_dir))
    shape = dict(pool_size=POOL_SIZE, max_running_requests=16, max_context_len=MAX_CONTEXT, attention_backend="torch")
    runner, eager_runner = GraphModelRunner(model, disable_cuda_graph=True, **shape), ModelRunner(model, **shape)
    assert runner.attn_backend.decode_through_table, "on a CPU the eager decode should read through the table"
    prompts = prompts_of(7)
    ours, theirs = start(runner, prompts), start(eager_runner, prompts)
    # step 0 prefills 5; then decodes of 5; a MIXED pass (4 decodes + 2 new prompts); decodes of 6 and 3
    schedule = [range(5), range(5), [0, 1, 2, 3, 5, 6], [0, 1, 2, 3, 5, 6], [1, 5, 6]]
    for step, rows in enumerate(schedule):
        batch, expected = run_pass(eager_runner, [theirs[i] for i in rows])
        tokens = expected.argmax(-1).tolist()
        ours_batch, got = run_pass(runner, [ours[i] for i in rows], tokens)
        if step > 0:
            meta = runner.attn_backend.decode_metadata
            assert meta is not None and meta.table is not None, f"step {step}: the decode did not go through the table"
        if step == 2:
            assert ours_batch.forward_mode is ForwardMode.MIXED, (
                f"step 2 should be a MIXED pass, got {ours_batch.forward_mode}"
            )
        worst = (got - expected).abs().max().item()
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (
            f"{tiny_model_dir.name}, step {step} ({ours_batch.forward_mode.value}, {len(rows)} requests): the CPU "
            f"decode through the table differs from stage 4's eager runner by up to {worst:.3g}"
        )
