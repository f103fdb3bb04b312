"""The fused element-wise loops of a CPU pass (s00 cpu_ops.cpp) compute what PyTorch's operators
compute (not graded: this code is given, not written).

RMSNorm, SiLU-and-multiply and RoPE against the model's own PyTorch path, on the views the model
hands them (rows of a split product, heads of a split q/k), on sizes the 16-float vectors divide
and on odd ones; RoPE to the bit; in bfloat16, rounded where PyTorch's operators round; the whole
model with and without them on every family; when they apply (float32 and bfloat16 CPU tensors
outside autograd) and what describe() says when they cannot be built. Where no C++ compiler is
here the tests skip and say so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_build import require_built
from reference import engine_model
from s00_foundation import cpu_ops
from s00_foundation.attention import NoCacheBackend
from s00_foundation.forward_batch import ForwardBatch
from s00_foundation.model import RMSNorm
from s00_foundation.rope import apply_rotary


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built(*cpu_ops.load(), "the fused CPU element-wise loops")


@pytest.fixture
def pytorch_path(monkeypatch):
    """Run a block with the model's PyTorch operators instead of the fused loops."""

    def switch():
        monkeypatch.setattr(cpu_ops, "applies", lambda x: False)

    return switch


def split_rows(rows: int, widths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Views of one [rows, sum(widths)] product's output, as linear_group returns them."""
    out = torch.randn(rows, sum(widths), generator=torch.Generator().manual_seed(seed))
    return list(out.split(widths, dim=-1))


@pytest.mark.parametrize("width", [16, 24, 576, 100])
@torch.inference_mode()
def test_rms_norm_equals_pytorch(width, pytorch_path):
    norm = RMSNorm(width, 1e-5)
    norm.weight.copy_(torch.randn(width))
    x, _ = split_rows(37, [width, 8])  # rows 8 floats apart from each other's ends
    heads = split_rows(5, [3 * width, width])[0].view(5, 3, width)  # a q-norm's split heads
    fused = [norm(x), norm(heads)]
    assert cpu_ops.applies(x)
    pytorch_path()
    for got, expected in zip(fused, [norm(x), norm(heads)]):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [16, 24, 1536])
@torch.inference_mode()
def test_silu_and_mul_equals_pytorch(width):
    gate, up = split_rows(19, [width, width], seed=1)
    gate = gate * 20  # large magnitudes both ways: exp must neither overflow nor lose the sign
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate, up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
@torch.inference_mode()
def test_rotary_equals_pytorch_to_the_bit(head_dim, pytorch_path):
    q, k, _ = split_rows(29, [4 * head_dim, 2 * head_dim, 2 * head_dim], seed=2)
    q, k = q.view(29, 4, head_dim), k.view(29, 2, head_dim)
    angles = torch.randn(29, head_dim // 2) * 30
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    fused = [apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)]
    pytorch_path()
    for got, expected in zip(fused, [apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)]):
        assert torch.equal(got, expected), f"RoPE differs from PyTorch's by up to {(got - expected).abs().max():.3g}"


@pytest.mark.parametrize("width", [24, 576])
@torch.inference_mode()
def test_bfloat16_loops_round_where_pytorch_does(width, pytorch_path):
    """In bfloat16 each loop rounds where the PyTorch chain it replaces stores a bfloat16 tensor
    (the normalised x before the weight, silu(gate) before the product, each RoPE product before
    the sum): RoPE gives PyTorch's bits, the norm and SiLU at most one unit of the last place off
    (their float32 sum and exp differ from PyTorch's in the last bits), and almost always none."""
    bf16 = torch.bfloat16
    norm = RMSNorm(width, 1e-5).to(bf16)
    norm.weight.copy_(torch.randn(width))
    x, _ = split_rows(37, [width, 8], seed=3)
    gate, up = split_rows(19, [width, width], seed=4)
    q = split_rows(29, [4 * 64, 8], seed=5)[0].view(29, 4, 64)
    angles = torch.randn(29, 32) * 30
    cos, sin = torch.cat((angles, angles), -1).cos().to(bf16), torch.cat((angles, angles), -1).sin().to(bf16)
    x, gate, up, q = x.to(bf16), (gate * 20).to(bf16), up.to(bf16), q.to(bf16)
    assert cpu_ops.applies(x), "the loops take bfloat16 CPU tensors"
    fused = {"rms_norm": norm(x), "silu_and_mul": cpu_ops.silu_and_mul(gate, up), "rotary": apply_rotary(q, cos, sin)}
    pytorch_path()
    expected = {"rms_norm": norm(x), "silu_and_mul": F.silu(gate) * up, "rotary": apply_rotary(q, cos, sin)}
    for name, got in fused.items():
        assert got.dtype == bf16, f"{name} should return bfloat16 for bfloat16 inputs, returned {got.dtype}"
        off = (got != expected[name]).float().mean().item()
        if name == "rotary":
            assert off == 0, f"RoPE in bfloat16 differs from PyTorch's in {off:.2%} of its values"
            continue
        assert off < 0.01, f"{name} in bfloat16 differs from PyTorch's in {off:.2%} of its values (rounded elsewhere?)"
        # one unit of bfloat16's 8 bits (and SiLU's exp, cut off near e^-87, may give ~1e-36 for PyTorch's 0)
        torch.testing.assert_close(got, expected[name], atol=1e-30, rtol=2**-7)


def test_model_with_and_without_the_fused_loops(tiny_model_dir, pytorch_path):
    model = engine_model(str(tiny_model_dir))
    requests = [list(range(3, 40)), [7], list(range(60, 75))]

    def logits():
        return model(ForwardBatch.build(requests, [0] * len(requests), NoCacheBackend()), return_all_logits=True)

    fused = logits()
    pytorch_path()
    torch.testing.assert_close(fused, logits(), atol=1e-4, rtol=1e-4)


def test_when_the_fused_loops_apply(monkeypatch):
    x = torch.randn(4, 16)
    assert not cpu_ops.applies(x), "outside inference_mode / no_grad autograd may record: PyTorch's operators"
    with torch.inference_mode():
        assert cpu_ops.applies(x)
        assert cpu_ops.applies(x.to(torch.bfloat16)), "the loops take bfloat16 too"
        assert not cpu_ops.applies(x.to(torch.float16)), "the loops take float32 and bfloat16 only"
    assert "fused C++ loops" in cpu_ops.kind(torch.device("cpu"))
    assert cpu_ops.kind(torch.device("cuda")) == "PyTorch operators"
    monkeypatch.setattr(cpu_ops, "load", lambda: (False, "no C++ compiler (test)"))
    with torch.inference_mode():
        assert not cpu_ops.applies(x)
    assert cpu_ops.kind(torch.device("cpu")) == "PyTorch operators (no C++ compiler (test))"


def test_the_loops_refuse_what_they_cannot_compute():
    with torch.inference_mode():
        x = torch.randn(4, 16)
        with pytest.raises(RuntimeError, match="weight has 8 entries for rows of 16"):
            torch.ops.engine_cpu_ops.rms_norm(x, torch.ones(8), 1e-5)
        with pytest.raises(RuntimeError, match="differ"):
            cpu_ops.silu_and_mul(x, torch.randn(4, 8))
        with pytest.raises(RuntimeError, match="head size must be even"):
            cpu_ops.rotary(torch.randn(4, 2, 15), torch.randn(4, 15), torch.randn(4, 15))
        with pytest.raises(RuntimeError, match="float32 or bfloat16"):
            cpu_ops.silu_and_mul(x.double(), x.double())
        with pytest.raises(RuntimeError, match="differ"):
            cpu_ops.rms_norm(x.to(torch.bfloat16), torch.ones(16), 1e-5)
