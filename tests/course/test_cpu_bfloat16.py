"""A bfloat16 model on a CPU (not graded: the kernels and their choice are provided code).

On a CPU with bfloat16 matrix units (AMX, AVX512-BF16) a bfloat16 model's products run several
times faster than float32's, and its KV pool is half the bytes. Checked here: the fused decode
kernel reads a bfloat16 pool as the float32 values it holds (each key widened exactly as it is
loaded), for grouped-query heads and head sizes it unrolls and odd ones, and hands a bfloat16
query its output in bfloat16, rounded once; a bfloat16 pool's decodes take that kernel; and the
whole model in bfloat16 through stage 8's CPU kernels (decodes and extends: the extend kernel's
bfloat16 is checked bit for bit in test_extend_kernel.py) is as close to the float32 model's
logits as stage 4's bfloat16 passes are. Where no C++ compiler is here the tests skip and say so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stage08"))
from graph_helpers import MAX_CONTEXT, POOL_SIZE, built_kernel, prompts_of, run_pass, start  # noqa: E402
from reference import engine_model  # noqa: E402
from s04_paged_kv_pool.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from s04_paged_kv_pool.model_runner import ModelRunner  # noqa: E402
from s08_cuda_graph.decode_attention import DecodeAttentionBackend  # noqa: E402
from s08_cuda_graph.model_runner import GraphModelRunner  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    return built_kernel()


def bfloat16_rows(num_heads: int, num_kv_heads: int, head_dim: int):
    """A bfloat16 pool, a float32 query and the table of rows of 37, 1, 12, 70 and 5 keys in
    scattered slots (slot 0 unused): (q, k16, v16, kv_indices, seq_lens)."""
    g = torch.Generator().manual_seed(0)
    lengths = [37, 1, 12, 70, 5]
    slots = 1 + sum(lengths)
    k16 = torch.randn(slots, num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v16 = torch.randn(slots, num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
    order = (torch.randperm(slots - 1, generator=g) + 1).tolist()
    kv_indices = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    for row, n in enumerate(lengths):
        kv_indices[row, :n] = torch.tensor(order[:n])
        order = order[n:]
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g)
    return q, k16, v16, kv_indices, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("head_dim", [24, 64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1)])
def test_the_decode_kernel_reads_a_bfloat16_pool_as_its_float32_values(kernel, num_heads, num_kv_heads, head_dim):
    q, k16, v16, kv_indices, seq_lens = bfloat16_rows(num_heads, num_kv_heads, head_dim)
    got = kernel.op(q, k16, v16, kv_indices, seq_lens, head_dim**-0.5)
    expected = kernel.op(q, k16.float(), v16.float(), kv_indices, seq_lens, head_dim**-0.5)
    worst = (got - expected).abs().max().item()
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-6), (
        f"{num_heads} heads over {num_kv_heads} of {head_dim}: the kernel on a bfloat16 pool differs by up to "
        f"{worst:.3g} from the same values in float32 (a bfloat16 widens to float32 exactly: its bits are the "
        "upper half)"
    )


@pytest.mark.parametrize("head_dim", [24, 64])
def test_a_bfloat16_query_gets_the_float32_output_rounded_once(kernel, head_dim):
    """A bfloat16 model's query goes in as it is and its output comes back in bfloat16: the bits
    of the float32 query's output rounded, as ``.to(torch.bfloat16)`` rounds (a head size the
    kernel unrolls and one it does not). A query of a third dtype is refused, saying which."""
    q, k16, v16, kv_indices, seq_lens = bfloat16_rows(9, 3, head_dim)
    q16 = q.to(torch.bfloat16)
    got = kernel.op(q16, k16, v16, kv_indices, seq_lens, head_dim**-0.5)
    expected = kernel.op(q16.float(), k16, v16, kv_indices, seq_lens, head_dim**-0.5).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16, f"a bfloat16 query's output should be bfloat16, got {got.dtype}"
    assert torch.equal(got, expected), (
        f"head_dim {head_dim}: {(got != expected).float().mean():.1%} of the outputs differ from the float32 "
        "query's output rounded to bfloat16 (a bfloat16 query widens exactly; the output rounds once, to nearest even)"
    )
    with pytest.raises(RuntimeError, match="q float32 or their dtype; got q Half"):
        kernel.op(q.half(), k16, v16, kv_indices, seq_lens, head_dim**-0.5)


def test_a_bfloat16_pool_decodes_by_the_kernel(kernel):
    table = ReqToTokenPool(2, 16)
    pool = TokenToKVPool(8, 1, num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    backend = DecodeAttentionBackend(table, pool)
    assert backend.decode_path == "fused", backend.decode_path_reason


def test_a_bfloat16_model_on_stage8s_cpu_paths_is_as_close_to_float32_as_stage4(kernel, tiny_model_dir):
    """Prefill, decodes and a MIXED pass of the whole model in bfloat16 (decodes and extends by the
    fused kernels, norms, SiLU and RoPE by s00's loops): no further from the float32 model's logits
    than stage 4's bfloat16 passes, on every family."""
    shape = dict(pool_size=POOL_SIZE, max_running_requests=16, max_context_len=MAX_CONTEXT, attention_backend="torch")
    path = str(tiny_model_dir)
    fused = GraphModelRunner(engine_model(path, torch.bfloat16), disable_cuda_graph=True, **shape)
    assert fused.attn_backend.decode_path == "fused", fused.attn_backend.decode_path_reason
    fused.attn_backend.extend_path = "fused"  # the extend kernel too, even on a CPU with AMX (where SDPA is chosen)
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
            f"{tiny_model_dir.name}, step {step}: the bfloat16 model on stage 8's CPU paths is "
            f"{errors['fused']:.3g} from the float32 logits, stage 4's bfloat16 passes {errors['stage4']:.3g}"
        )
