"""Fused element-wise steps for a CPU pass: RMSNorm, SiLU-and-multiply and RoPE, each one C++ loop
(cpu_ops.cpp) instead of a chain of PyTorch operators.

Between its matrix products a decoder layer runs small element-wise steps: two RMSNorms (square,
mean, add, rsqrt, two multiplies), SwiGLU's ``silu(gate) * up``, RoPE for q and k (slices, a
negation, a concatenation, two multiplies, an add). Eagerly each operator is a call that reads its
input from memory and writes a new tensor, so a norm of 128 rows is seven passes over them where
one loop needs two. On a GPU that is what kernel fusion (SGLang's ``sgl_kernel`` ops, or
``torch.compile``) removes; on a CPU these loops are the same idea, written out once.

Measured on this course's CPU (SmolLM2-135M, float32, 2 torch threads, one bare model pass, the
fused steps and PyTorch's alternating in one process, the best of six, load 1.8 in a slow hour of
the host): a decode pass of 16 rows 95.8 -> 84.2 ms, of 64 rows 194.5 -> 172.8, of 128 rows
302.5 -> 235.3; a 512-token prefill 680.1 -> 570.2 ms.

``applies(x)`` says when a step takes the fused loop: ``x`` is a float32 or bfloat16 CPU tensor, no autograd
is recording (the model runs under ``torch.inference_mode``), no ``torch.compile`` is tracing
(Inductor fuses these steps itself), and the loops are built here (s00 cpu_extension.py: the
first call compiles them, seconds, cached; no compiler or ``ENGINE_CPU_KERNELS=off``: PyTorch's
operators, the same results to float rounding). RoPE's loop rounds exactly as PyTorch's operators
do; the norm's sum and SiLU's exp differ in the last bits.

In bfloat16 the loops compute in float32 and round where PyTorch's bfloat16 operators store a
result (the normalised x before the weight, ``silu(gate)`` before the product, each RoPE product
before the sum), so they give the bits PyTorch's chain gives (tests/foundation/test_cpu_ops.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .cpu_extension import build

NAME = "engine_cpu_ops"
SOURCES = [Path(__file__).with_name("cpu_ops.cpp")]
DTYPES = (torch.float32, torch.bfloat16)  # what the loops take (in bfloat16 they round as PyTorch's operators do)


@functools.cache  # once per process: the library, once loaded, stays registered with torch
def load() -> tuple[bool, str]:
    """Build (or find in the cache) and load the loops: (loaded, the flags or why not). No
    contraction of a * b + c into one rounding (fused multiply-add), so that RoPE rounds as
    PyTorch does."""
    return build(NAME, SOURCES, extra_flags=("-ffp-contract=off",))


def applies(x: torch.Tensor) -> bool:
    """A step on ``x`` runs the fused loop (see above); the cheap checks first, the build last."""
    return (
        x.is_cpu
        and x.dtype in DTYPES
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and load()[0]
    )


def kind(device: torch.device) -> str:
    """How the element-wise steps run on ``device`` (for an engine's describe())."""
    if device.type != "cpu":
        return "PyTorch operators"
    loaded, how = load()
    return f"fused C++ loops, built with {how}" if loaded else f"PyTorch operators ({how})"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape), one loop per row."""
    rows = x.reshape(-1, x.shape[-1])  # a view where the rows allow it (a copy for a q/k norm's split heads)
    return torch.ops.engine_cpu_ops.rms_norm(rows, weight, eps).view(x.shape)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for [rows, N] views (SwiGLU), in one pass."""
    return torch.ops.engine_cpu_ops.silu_and_mul(gate, up)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` [T, heads, D] by ``cos``/``sin`` [T, D] (rope.py's ``apply_rotary``), one pass."""
    return torch.ops.engine_cpu_ops.rotary(x, cos, sin)
