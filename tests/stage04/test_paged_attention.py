"""Stage 4 (graded): attention through the request -> slots table, for a ragged batch that
mixes a fresh prefill, an extend after a cached prefix and a decode."""

from __future__ import annotations

import math

import pytest
import torch

from reference import assert_same_tokens, engine_model, hf_greedy, hf_last_logits
from s00_foundation.attention import causal_attention
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool import flash_backend
from s04_paged_kv_pool.engine import StaticBatchEngine, generate_static_batch

A = list(b"The quick brown fox jumps over the lazy dog.")
B = list(b"Hello, world")
C = list(b"Paged attention!")


def req(rid, ids):
    return Req(
        rid=rid, origin_input_ids=ids, sampling_params=SamplingParams(temperature=0, max_new_tokens=4), eos_token_ids=[]
    )


def run(engine, reqs):
    batch = engine.prepare_forward(reqs)
    logits = engine.runner.forward(batch)
    for r in reqs:
        r.cached_len = r.device_len
    return batch, logits


@pytest.mark.parametrize("page_size", [1, 4])
def test_one_batch_mixing_prefill_extend_and_decode(tiny_model_dir, page_size):
    model = engine_model(str(tiny_model_dir))
    engine = StaticBatchEngine(model, pool_size=128, page_size=page_size, max_running_requests=4)
    a, b, c = req(0, A), req(1, B), req(2, C)
    # Added in reverse, they take table rows 2, 1, 0: a batch's rows need not rise in its order
    # (from stage 5 on, a leaving request's row goes to whoever comes next).
    engine.add_requests([c, b, a])
    # Pass 1: the first 13 tokens of A (a chunk of its prompt) and all of B.
    a.device_len = 13
    engine.running = [a, b]
    run(engine, [a, b])
    # Pass 2, one ragged batch: the rest of A after its cached 13, one decode token for B, and C from scratch.
    a.device_len = len(A)
    b.output_ids.append(ord("!"))
    b.device_len += 1
    batch, logits = run(engine, [a, b, c])
    assert batch.extend_lens == [len(A) - 13, 1, len(C)] and batch.prefix_lens == [13, len(B), 0], (
        f"the mixed batch should send {[len(A) - 13, 1, len(C)]} new tokens after {[13, len(B), 0]} cached ones, "
        f"your prepare_forward built extend_lens={batch.extend_lens}, prefix_lens={batch.prefix_lens}"
    )
    # Attention reads K/V through the table: each request's new slots must sit at their positions.
    table = engine.runner.req_to_token_pool.req_to_token
    start = 0
    for r, prefix, seq in zip((a, b, c), batch.prefix_lens, batch.seq_lens):
        new, row = (
            batch.out_cache_loc[start : start + seq - prefix].tolist(),
            table[r.req_pool_idx, prefix:seq].tolist(),
        )
        wrong = [i for i in range(len(new)) if row[i] != new[i]]
        assert not wrong, (
            f"request {r.rid}: its req_to_token row should hold the slots of its new tokens (out_cache_loc, in order) "
            f"at positions {prefix}..{seq - 1}, written before the pass; position {prefix + wrong[0]} holds "
            f"{row[wrong[0]]}, not {new[wrong[0]]} ({len(wrong)} of {len(new)} positions wrong)"
        )
        start += seq - prefix
    cases = [("A: extend after a cached prefix of 13", A), ("B: decode", B + [ord("!")]), ("C: prefill", C)]
    for row, (what, sequence) in enumerate(cases):
        torch.testing.assert_close(
            logits[row],
            hf_last_logits(tiny_model_dir, sequence),
            atol=2e-4,
            rtol=1e-4,
            msg=lambda m, what=what: (
                f"{tiny_model_dir.name}, page size {page_size}, request {what}: logits differ from transformers: {m}. "
                "Attention reads each request's K/V through kv_indices, from its own table row (this batch's rows, "
                f"in its order: {batch.req_pool_indices.tolist()})"
            ),
        )
    owners = [table[r.req_pool_idx, : r.cached_len] for r in (a, b, c)]
    engine.runner.allocator.check_invariants(owners)


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, block_table=None):
    """What flash_attn_varlen_func computes, in plain PyTorch (so the wiring is tested on a CPU)."""
    assert causal, "the flash path must ask for causal attention"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32, "flash-attn wants int32 cu_seqlens"
    qo, kv = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(qo, qo[1:])), "max_seqlen_q must be the longest query run"
    assert max_seqlen_k == max(b - a for a, b in zip(kv, kv[1:])), "max_seqlen_k must be the longest key run"
    out = []
    for i in range(len(qo) - 1):
        n = kv[i + 1] - kv[i]
        if block_table is None:
            ki, vi = k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]]
        else:
            pages = block_table[i, : math.ceil(n / k.shape[1])].long()
            ki, vi = k[pages].flatten(0, 1)[:n], v[pages].flatten(0, 1)[:n]
        out.append(causal_attention(q[qo[i] : qo[i + 1]], ki, vi))
    return torch.cat(out)


@pytest.mark.parametrize("page_size", [4, 256], ids=["gathered K/V", "block table"])
def test_flash_attention_wiring_against_a_reference_kernel(tiny_models_root, monkeypatch, page_size):
    """The CUDA flash-attn path, run on the CPU with a stand-in for the kernel: checks what the
    backend hands the kernel (indptr arrays, gathered K/V or the block table)."""
    monkeypatch.setattr(flash_backend, "flash_attn_varlen_func", reference_varlen)
    path = tiny_models_root / "qwen2"
    prompts, n = [A, [72], B], 8
    got = generate_static_batch(engine_model(str(path)), prompts, n, page_size=page_size, attention_backend="flash")
    for i, prompt in enumerate(prompts):
        assert_same_tokens(got[i], hf_greedy(path, prompt, n), f"flash path, page size {page_size}, request {i}")
