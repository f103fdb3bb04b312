"""The fused element-wise loops of a CPU pass (s00 cpu_ops.cpp) compute what PyTorch's operators
compute (not graded: this code is given, not written).

RMSNorm, SiLU-and-multiply and RoPE against the model's own PyTorch path, on the views the model
hands them (rows of a split product, heads of a split q/k), on sizes the 16-float vectors divide
and on odd ones; RoPE to the bit; the whole model with and without them on every family; when
they apply (float32 CPU tensors outside autograd) and what describe() says when they cannot be
built. Where no C++ compiler is here the tests skip and say so."""

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
        assert not cpu_ops.applies(x.to(torch.bfloat16)), "the loops are float32 only"
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
        with pytest.raises(RuntimeError, match="float32"):
            cpu_ops.silu_and_mul(x.double(), x.double())
