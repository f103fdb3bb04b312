"""Stage 8 (graded): a CPU's eager decode runs the fused C++ kernel (decode_kernel.cpp), and it
computes what your gathered decode computes.

The kernel is provided; these tests hold it to your code: its output equals your
``attend_decode`` on the metadata your ``fill_decode_metadata`` builds (GQA group sizes 1, 3, 5, 8, the
head sizes it unrolls and odd ones, rows of very different lengths, a padding row), it reads
nothing but each row's first seq_len slots, it refuses metadata that would read outside the pool
with an error that says what is wrong (and the process goes on), and the engine's CPU decode, by
the kernel or (no compiler) through the table, gives stage 4's logits for every family in DECODE
and MIXED passes. Where this machine has no C++ compiler the kernel tests skip and say so; a
kernel that a compiler here fails to build is a failure."""

from __future__ import annotations

import pytest
import torch

from graph_helpers import (
    MAX_CONTEXT,
    POOL_SIZE,
    backend_with_rows,
    built_kernel,
    check_decode_metadata,
    prompts_of,
    run_pass,
    start,
)
from reference import engine_model
from s00_foundation.forward_batch import ForwardMode
from s04_paged_kv_pool.model_runner import ModelRunner
from s08_cuda_graph import decode_kernel
from s08_cuda_graph.model_runner import GraphModelRunner


@pytest.fixture(scope="module")
def kernel():
    """The built kernel; a skip with the reason where nothing here can build it."""
    return built_kernel().op


def run_kernel(kernel, backend, meta, q):
    pool = backend.token_to_kv_pool
    return kernel(
        q, pool.get_key_buffer(0), pool.get_value_buffer(0), meta.kv_indices, meta.seq_lens, q.shape[-1] ** -0.5
    )


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (9, 3), (10, 2), (8, 1)])
def test_fused_kernel_equals_your_gathered_decode(kernel, num_heads, num_kv_heads, head_dim):
    lengths = [37, 1, 0, 12, 70, 5]  # row 2: a padding row (the dummy slot only)
    backend, meta = backend_with_rows(num_kv_heads, lengths, head_dim)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    expected = backend.attend_decode(q, 0, meta.kv_indices, meta.key_mask)
    got = run_kernel(kernel, backend, meta, q)
    assert got.shape == expected.shape
    worst = (got - expected).abs().max().item()
    group = num_heads // num_kv_heads
    gqa = (
        f"; query head h reads KV head h // {group} (each KV head serves {group} neighbouring query heads)"
        if group > 1
        else ""
    )
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (
        f"{num_heads} query heads over {num_kv_heads} KV heads of {head_dim}, rows of {lengths} tokens: the fused "
        f"kernel and your attend_decode differ by up to {worst:.3g} (check attend_decode: one masked attention "
        f"over each row's gathered keys{gqa})"
    )


def test_fused_kernel_reads_only_each_rows_first_seq_len_slots(kernel):
    backend, meta = backend_with_rows(2, [9, 20, 3])
    pool = backend.token_to_kv_pool
    q = torch.randn(3, 4, 16)
    before = run_kernel(kernel, backend, meta, q)
    used = {s for row, n in zip(meta.kv_indices.tolist(), meta.seq_lens.tolist()) for s in row[:n]}
    others = torch.tensor(sorted(set(range(pool.num_slots)) - used))
    pool.k_buffer[0][others] = float("nan")  # any read of them would spread NaN into the output
    pool.v_buffer[0][others] = float("nan")
    after = run_kernel(kernel, backend, meta, q)
    assert torch.equal(before, after), "a row's output changed when slots outside its first seq_len entries did"


def test_fused_kernel_refuses_metadata_outside_the_pool(kernel):
    backend, meta = backend_with_rows(2, [9, 20, 3])
    pool = backend.token_to_kv_pool
    q = torch.randn(3, 4, 16)
    expected = run_kernel(kernel, backend, meta, q)
    bad_slot = meta.kv_indices.clone()
    bad_slot[1, 4] = pool.num_slots + 10
    bad_length = meta.seq_lens.clone()
    bad_length[2] = meta.kv_indices.shape[1] + 1
    cases = [  # (kv_indices, seq_lens, what the error must say)
        (bad_slot, meta.seq_lens, "outside the pool"),
        (meta.kv_indices, bad_length, "seq_len"),
        (meta.kv_indices, meta.seq_lens.long(), "int32"),
    ]
    for kv_indices, seq_lens, words in cases:
        with pytest.raises(RuntimeError, match=words):
            kernel(q, pool.get_key_buffer(0), pool.get_value_buffer(0), kv_indices, seq_lens, 0.25)
    assert torch.equal(run_kernel(kernel, backend, meta, q), expected), "a refused call changed what follows"


@pytest.mark.parametrize("path", ["fused", "table"])
def test_cpu_eager_decode_equals_stage4(tiny_model_dir, path, monkeypatch, request):
    if path == "fused":
        request.getfixturevalue("kernel")  # skips where it cannot be built
    else:  # a machine with no compiler: the backend falls back to the table by itself
        monkeypatch.setattr(decode_kernel, "load", lambda: decode_kernel.DecodeKernel(None, "no C++ compiler (test)"))
    model = engine_model(str(tiny_model_dir))
    shape = dict(pool_size=POOL_SIZE, max_running_requests=16, max_context_len=MAX_CONTEXT, attention_backend="torch")
    runner, eager_runner = GraphModelRunner(model, disable_cuda_graph=True, **shape), ModelRunner(model, **shape)
    assert runner.attn_backend.decode_path == path, (
        f"on a CPU the eager decode should take the {path!r} path here, took {runner.attn_backend.decode_path!r}"
    )
    said = {"fused": "by the fused CPU kernel", "table": "through the table"}[path]
    assert said in runner.attention_backend_name, f"describe() should say the decode runs {said}"
    # the prefill (step 0) and the MIXED pass's new prompts: the fused extend kernel, or stage 4's path
    extend_path = "fused" if path == "fused" else "per-request"
    assert runner.attn_backend.extend_path == extend_path, (
        f"the extends should take the {extend_path!r} path here, took {runner.attn_backend.extend_path!r}"
    )
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
            assert meta is not None and meta.path == path, f"step {step}: the decode did not take the {path} path"
            # your fill_decode_metadata's tables, by name, before the logits they lead to
            rows = ours_batch.req_pool_indices[: meta.kv_indices.shape[0]]
            check_decode_metadata(meta, rows, runner.req_to_token_pool.req_to_token, meta.seq_lens.tolist())
            assert (meta.table is not None) == (path == "table"), f"step {step}: table index arrays built or missing"
        if step == 2:
            assert ours_batch.forward_mode is ForwardMode.MIXED, (
                f"step 2 should be a MIXED pass, got {ours_batch.forward_mode}"
            )
        worst = (got - expected).abs().max().item()
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (
            f"{tiny_model_dir.name}, step {step} ({ours_batch.forward_mode.value}, {len(rows)} requests): the CPU "
            f"decode ({path}) differs from stage 4's eager runner by up to {worst:.3g}"
        )
