"""The fused CPU extend attention (s08 extend_kernel.cpp) computes what stage 4's per-request path
computes (not graded: the kernel is provided code; the graded stage-8 engine tests run their
prefills and MIXED passes through it, so they stand on what is checked here).

Checked against ``PagedAttentionBackend`` (gather + one SDPA per request) on the same pool:
grouped-query heads of several group sizes, head sizes the kernel's tiles divide and odd ones,
extends after cached prefixes and from nothing, one-token extends, requests longer than a key block
and than a task's rows, slots scattered over the pool, EXTEND and MIXED passes; that it reads no
slot but each request's own; and that metadata which would read outside the pool or the table is
refused with an error that says what is wrong, after which the next call still computes the same;
that a bfloat16 pool gets the float32 result rounded once; and which path a pool takes (a bfloat16
one by the kernel unless the CPU has AMX). Where no C++ compiler is here the tests skip and say so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stage08"))
from graph_helpers import built_kernel  # noqa: E402
from s00_foundation.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from s04_paged_kv_pool.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from s04_paged_kv_pool.paged_backend import PagedAttentionBackend  # noqa: E402
from s08_cuda_graph import decode_attention, decode_kernel  # noqa: E402
from s08_cuda_graph.decode_attention import DecodeAttentionBackend, ExtendMetadata  # noqa: E402

# (prefix_len, extend_len) per request: from nothing, after a prefix, one new token after a prefix,
# longer than a 64-key block, more rows than a task's 96, a long prefix
REQUESTS = [(0, 7), (5, 3), (9, 1), (0, 100), (37, 64), (150, 130)]


@pytest.fixture(scope="module")
def kernel():
    return built_kernel()


def extend_case(num_heads, num_kv_heads, head_dim, requests, seed=0):
    """A one-layer pool whose table rows hold each request's prefix in scattered slots (random K/V),
    the pass's batch (its new tokens' slots scattered too) and random q, k, v for the new tokens."""
    g = torch.Generator().manual_seed(seed)
    total = sum(p + e for p, e in requests)
    kv = TokenToKVPool(total + 20, 1, num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim)
    for buffer in (kv.k_buffer[0], kv.v_buffer[0]):
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    table = ReqToTokenPool(len(requests) + 2, max(p + e for p, e in requests) + 5)
    slots = (torch.randperm(total + 20, generator=g) + 1).tolist()
    rows = [r + 2 for r in range(len(requests))]  # not table rows 0 and 1
    new_slots = []
    for row, (p, e) in zip(rows, requests):
        table.req_to_token[row, : p + e] = torch.tensor(slots[: p + e])
        new_slots += slots[p : p + e]
        slots = slots[p + e :]
    batch = ForwardBatch.build(
        [[1] * e for _, e in requests],
        [p for p, _ in requests],
        None,
        req_pool_indices=rows,
        out_cache_loc=torch.tensor(new_slots),
    )
    t = sum(e for _, e in requests)
    q = torch.randn(t, num_heads, head_dim, generator=g)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g)
    return table, kv, batch, (q, k, v)


def copy_of(kv: TokenToKVPool) -> TokenToKVPool:
    other = TokenToKVPool(kv.num_slots - 1, 1, 1, kv.k_buffer[0].shape[1], kv.k_buffer[0].shape[2])
    other.k_buffer[0].copy_(kv.k_buffer[0])
    other.v_buffer[0].copy_(kv.v_buffer[0])
    return other


def both(table, kv, batch, qkv):
    """(the fused backend's output, stage 4's output) for the same pass over copies of the pool."""
    fused = DecodeAttentionBackend(table, kv)
    assert fused.extend_path == "fused", (
        f"a float32 CPU pool should take the fused extend path: {fused.extend_path_reason}"
    )
    reference = PagedAttentionBackend(table, copy_of(kv))
    fused.init_forward_metadata(batch)
    reference.init_forward_metadata(batch)
    return fused.forward(*qkv, 0, batch), reference.forward(*qkv, 0, batch)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (9, 3), (10, 2), (8, 1)])
def test_fused_extend_equals_stage4(kernel, num_heads, num_kv_heads, head_dim):
    got, expected = both(*extend_case(num_heads, num_kv_heads, head_dim, REQUESTS))
    assert got.shape == expected.shape
    worst = (got - expected).abs().max().item()
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (
        f"{num_heads} query heads over {num_kv_heads} KV heads of {head_dim}, requests {REQUESTS}: the fused "
        f"extend and stage 4's per-request attention differ by up to {worst:.3g}"
    )


def test_fused_extend_in_a_mixed_pass(kernel):
    requests = [(12, 1), (30, 1), (0, 40), (20, 70)]  # two decodes first, then two extends
    table, kv, batch, qkv = extend_case(9, 3, 64, requests)
    assert batch.forward_mode is ForwardMode.MIXED
    got, expected = both(table, kv, batch, qkv)
    worst = (got - expected).abs().max().item()
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (
        f"a MIXED pass {requests}: decode + fused extend differ from stage 4 by up to {worst:.3g}"
    )


def test_fused_extend_reads_only_each_requests_slots(kernel):
    table, kv, batch, qkv = extend_case(6, 2, 16, REQUESTS)
    before, _ = both(table, copy_of(kv), batch, qkv)
    used = {
        s
        for row, (p, e) in zip(batch.req_pool_indices.tolist(), REQUESTS)
        for s in table.req_to_token[row, : p + e].tolist()
    }
    others = torch.tensor(sorted(set(range(kv.num_slots)) - used))
    kv.k_buffer[0][others] = float("nan")  # any read of them would spread NaN into the output
    kv.v_buffer[0][others] = float("nan")
    backend = DecodeAttentionBackend(table, kv)
    backend.init_forward_metadata(batch)
    after = backend.forward(*qkv, 0, batch)
    assert torch.equal(before, after), "an output changed when slots outside its request's table entries did"


def test_fused_extend_refuses_metadata_outside_the_pool_or_table(kernel):
    table, kv, batch, (q, k, v) = extend_case(6, 2, 16, REQUESTS)
    backend = DecodeAttentionBackend(table, kv)
    backend.init_forward_metadata(batch)
    expected = backend.forward(q, k, v, 0, batch)
    meta = backend.extend_metadata
    width = table.req_to_token.shape[1]
    bad_table = table.req_to_token.clone()
    bad_table[meta.req_pool_indices[3], 50] = kv.num_slots + 10
    too_long = meta.extend_lens.clone()
    too_long[5] = width
    cases = [  # (req_to_token, req_pool_indices, prefix_lens, extend_lens, what the error must say)
        (bad_table, meta.req_pool_indices, meta.prefix_lens, meta.extend_lens, "outside the pool"),
        (table.req_to_token, meta.req_pool_indices + 100, meta.prefix_lens, meta.extend_lens, "outside the table"),
        (table.req_to_token, meta.req_pool_indices, meta.prefix_lens, too_long, "the table's width"),
        (table.req_to_token, meta.req_pool_indices, meta.prefix_lens + 0, meta.extend_lens * 0 + 1, "add up to"),
        (table.req_to_token, meta.req_pool_indices, meta.prefix_lens.int(), meta.extend_lens, "int64"),
    ]
    for req_to_token, rows, prefix_lens, extend_lens, words in cases:
        with pytest.raises(RuntimeError, match=words):
            kernel.extend_op(q, kv.k_buffer[0], kv.v_buffer[0], req_to_token, rows, prefix_lens, extend_lens, 0.25)
    backend.init_forward_metadata(batch)
    assert torch.equal(backend.forward(q, k, v, 0, batch), expected), "a refused call changed what follows"


@pytest.mark.parametrize("head_dim", [16, 24])
def test_a_bfloat16_pool_extends_as_its_float32_values_rounded_once(kernel, head_dim):
    """On a bfloat16 pool (q, K and V in bfloat16) the kernel widens every value exactly and computes
    in float32, so its output is the float32 call's on the same values, rounded once to bfloat16:
    bit for bit (one head size a whole number of vectors, one not)."""
    table, kv, batch, qkv = extend_case(9, 3, head_dim, REQUESTS)
    q16 = qkv[0].to(torch.bfloat16)
    k16, v16 = kv.k_buffer[0].to(torch.bfloat16), kv.v_buffer[0].to(torch.bfloat16)
    meta = ExtendMetadata.of(batch)
    args = (table.req_to_token, meta.req_pool_indices, meta.prefix_lens, meta.extend_lens, head_dim**-0.5)
    got = kernel.extend_op(q16, k16, v16, *args)
    expected = kernel.extend_op(q16.float(), k16.float(), v16.float(), *args).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16, f"a bfloat16 pool's extend should return bfloat16, returned {got.dtype}"
    assert torch.equal(got, expected), (
        f"{(got != expected).float().mean():.1%} of the outputs differ from the float32 call's on the same values, "
        "rounded to bfloat16 (a bfloat16 widens to float32 exactly; the output should round once)"
    )
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        kernel.extend_op(qkv[0], k16, v16, *args)


def test_extend_path_follows_the_pool_the_cpu_and_the_kernel(kernel, monkeypatch):
    table, kv, _, _ = extend_case(4, 2, 16, [(0, 3)])
    assert DecodeAttentionBackend(table, kv).extend_path == "fused"
    bf16 = TokenToKVPool(8, 1, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    for amx, expected in ((False, "fused"), (True, "per-request")):
        monkeypatch.setattr(decode_attention, "cpu_has_amx", lambda amx=amx: amx)
        backend = DecodeAttentionBackend(table, bf16)
        assert backend.extend_path == expected, (
            f"a bfloat16 pool on a CPU {'with' if amx else 'without'} AMX should extend by the "
            f"{expected!r} path (PyTorch's SDPA multiplies bfloat16 faster only on AMX), took "
            f"{backend.extend_path!r}: {backend.extend_path_reason}"
        )
        assert not amx or "AMX" in backend.extend_path_reason, backend.extend_path_reason
    half = TokenToKVPool(8, 1, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    backend = DecodeAttentionBackend(table, half)
    assert backend.extend_path == "per-request" and "float16" in backend.extend_path_reason
    monkeypatch.setattr(decode_kernel, "load", lambda: decode_kernel.DecodeKernel(None, "no C++ compiler (test)"))
    backend = DecodeAttentionBackend(table, kv)
    assert backend.extend_path == "per-request" and "no C++ compiler" in backend.extend_path_reason
