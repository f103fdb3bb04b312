"""The fused CPU extend attention (s08 extend_kernel.cpp) computes what stage 4's per-request path
computes (not graded: the kernel is provided code; the graded stage-8 engine tests run their
prefills and MIXED passes through it, so they stand on what is checked here).

Checked against ``PagedAttentionBackend`` (gather + one SDPA per request) on the same pool:
grouped-query heads of several group sizes, head sizes the kernel's tiles divide and odd ones,
extends after cached prefixes and from nothing, one-token extends, requests longer than a key block
and than a task's rows, slots scattered over the pool, EXTEND and MIXED passes; that it reads no
slot but each request's own; and that metadata which would read outside the pool or the table is
refused with an error that says what is wrong, after which the next call still computes the same.
Both kernels (decode and extend) also read a bfloat16 pool: a MIXED pass in bfloat16 gives what
they give on a float32 pool holding the same values, and stays within bfloat16's rounding of stage
4's path. Where no C++ compiler is here the tests skip and say so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stage08"))
from graph_helpers import MAX_CONTEXT, POOL_SIZE, built_kernel, prompts_of, run_pass, start  # noqa: E402
from reference import engine_model  # noqa: E402
from s00_foundation.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from s04_paged_kv_pool.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from s04_paged_kv_pool.model_runner import ModelRunner  # noqa: E402
from s04_paged_kv_pool.paged_backend import PagedAttentionBackend  # noqa: E402
from s08_cuda_graph import decode_kernel  # noqa: E402
from s08_cuda_graph.decode_attention import DecodeAttentionBackend  # noqa: E402
from s08_cuda_graph.model_runner import GraphModelRunner  # noqa: E402

# (prefix_len, extend_len) per request: from nothing, after a prefix, one new token after a prefix,
# longer than a 64-key block, more rows than a task's 96, a long prefix
REQUESTS = [(0, 7), (5, 3), (9, 1), (0, 100), (37, 64), (150, 130)]


@pytest.fixture(scope="module")
def kernel():
    return built_kernel()


def extend_case(num_heads, num_kv_heads, head_dim, requests, seed=0, dtype=torch.float32):
    """A one-layer pool whose table rows hold each request's prefix in scattered slots (random K/V),
    the pass's batch (its new tokens' slots scattered too) and random q, k, v for the new tokens."""
    g = torch.Generator().manual_seed(seed)
    total = sum(p + e for p, e in requests)
    kv = TokenToKVPool(total + 20, 1, num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
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
    q = torch.randn(t, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    return table, kv, batch, (q, k, v)


def copy_of(kv: TokenToKVPool, dtype: torch.dtype | None = None) -> TokenToKVPool:
    """The pool's values in a new pool (of ``dtype``: float32 holds a bfloat16 pool's values exactly)."""
    shape = kv.k_buffer[0].shape[1:]
    other = TokenToKVPool(kv.num_slots - 1, 1, 1, *shape, dtype=dtype or kv.k_buffer[0].dtype)
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


def test_extend_path_follows_the_pool_and_the_kernel(kernel, monkeypatch):
    table, kv, _, _ = extend_case(4, 2, 16, [(0, 3)])
    assert DecodeAttentionBackend(table, kv).extend_path == "fused"
    bf16 = TokenToKVPool(8, 1, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    assert DecodeAttentionBackend(table, bf16).extend_path == "fused", "the kernel reads a bfloat16 pool too"
    f64 = TokenToKVPool(8, 1, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float64)
    path, reason = (
        DecodeAttentionBackend(table, f64).extend_path,
        DecodeAttentionBackend(table, f64).extend_path_reason,
    )
    assert path == "per-request" and "float64" in reason, (path, reason)
    monkeypatch.setattr(decode_kernel, "load", lambda: decode_kernel.DecodeKernel(None, "no C++ compiler (test)"))
    backend = DecodeAttentionBackend(table, kv)
    assert backend.extend_path == "per-request" and "no C++ compiler" in backend.extend_path_reason


def test_a_bfloat16_pool_is_read_as_its_float32_values(kernel):
    """A MIXED pass (fused decode and fused extend) on a bfloat16 pool: each bfloat16 key and value
    widens to float32 exactly, so the pass gives what it gives on a float32 pool holding the same
    values, rounded once to bfloat16 at the end; and it stays within bfloat16's rounding of stage 4's
    gather + SDPA on the same bfloat16 pool."""
    requests = [(12, 1), (30, 1), (0, 40), (20, 70)]
    table, kv16, batch, qkv16 = extend_case(9, 3, 64, requests, dtype=torch.bfloat16)
    fused = DecodeAttentionBackend(table, kv16)
    assert (fused.decode_path, fused.extend_path) == ("fused", "fused"), (
        f"a bfloat16 CPU pool should take both fused paths: {fused.decode_path_reason}; {fused.extend_path_reason}"
    )
    kv32 = copy_of(kv16, torch.float32)
    reference = PagedAttentionBackend(table, copy_of(kv16))
    widened = DecodeAttentionBackend(table, kv32)
    for backend in (fused, reference, widened):
        backend.init_forward_metadata(batch)
    got = fused.forward(*qkv16, 0, batch)
    assert got.dtype == torch.bfloat16, f"a bfloat16 pass should return bfloat16, returned {got.dtype}"
    in_float32 = widened.forward(*(x.float() for x in qkv16), 0, batch)
    torch.testing.assert_close(got.float(), in_float32, atol=1e-6, rtol=2**-8)  # within half a bfloat16 unit
    stage4 = reference.forward(*qkv16, 0, batch)
    worst = (got.float() - stage4.float()).abs().max().item()
    assert torch.allclose(got.float(), stage4.float(), atol=2e-2, rtol=2e-2), (
        f"a bfloat16 MIXED pass {requests}: the fused kernels and stage 4 differ by up to {worst:.3g}"
    )


def test_a_bfloat16_model_through_the_kernels_is_as_close_to_float32_as_stage4(kernel, tiny_model_dir):
    """The whole model in bfloat16: passes whose every attention runs in the fused kernels (and
    norms, SiLU and RoPE in s00's loops) are no further from the float32 model's logits than stage
    4's bfloat16 passes (gather + SDPA) are. Prefill, decodes and a MIXED pass, on every family."""
    shape = dict(pool_size=POOL_SIZE, max_running_requests=16, max_context_len=MAX_CONTEXT, attention_backend="torch")
    path = str(tiny_model_dir)
    fused = GraphModelRunner(engine_model(path, torch.bfloat16), disable_cuda_graph=True, **shape)
    assert (fused.attn_backend.decode_path, fused.attn_backend.extend_path) == ("fused", "fused")
    stage4, truth = ModelRunner(engine_model(path, torch.bfloat16), **shape), ModelRunner(engine_model(path), **shape)
    prompts = prompts_of(7)
    reqs = {name: start(runner, prompts) for name, runner in (("fused", fused), ("stage4", stage4), ("truth", truth))}
    schedule = [range(5), range(5), [0, 1, 2, 3, 5, 6], [0, 1, 2, 3, 5, 6], [1, 5, 6]]
    for step, rows in enumerate(schedule):
        _, expected = run_pass(truth, [reqs["truth"][i] for i in rows])
        tokens = expected.argmax(-1).tolist()  # every runner goes on with the float32 model's tokens
        errors = {}
        for name, runner in (("fused", fused), ("stage4", stage4)):
            _, got = run_pass(runner, [reqs[name][i] for i in rows], tokens)
            errors[name] = (got.float() - expected).abs().max().item()
        # (a bfloat16 misread or a dtype mixed up is off by the logits' own size, ~10)
        assert errors["fused"] <= 2 * errors["stage4"] + 0.1, (
            f"{tiny_model_dir.name}, step {step}: the bfloat16 model through the fused kernels is "
            f"{errors['fused']:.3g} from the float32 logits, stage 4's bfloat16 passes {errors['stage4']:.3g}"
        )
