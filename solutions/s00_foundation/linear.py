"""Linear layers whose weights are reordered once for the CPU's matrix-product library.

``y = x W^T`` on a CPU runs in a GEMM library, and a GEMM kernel does not read ``W`` as it is
stored: it reads it in blocks, laid out for its vector registers and caches. A plain call
(``F.linear``, MKL underneath) lays those blocks out anew on every call; oneDNN (PyTorch's other
CPU library, the one vLLM's CPU build uses for the same purpose) can take a weight that was
reordered into its blocked layout once, ahead of time ("prepacked"). A decode step multiplies a
few rows by every weight of the model, so the per-call layout work is a large share of it.

Measured on this course's CPU (SmolLM2-135M's shape, float32, one bare model pass, 1 torch
thread): 4 rows 91 -> 60 ms, 8 rows 119 -> 71, 16 rows 110 -> 85, 32 rows 133 -> 111, 64 rows
176 -> 160, 128 rows 275 -> 250; with 2 threads 6-18% less. For one to three rows the plain call
is faster (a single row: 52 ms against 60), so those keep it: every weight is kept as it is (the
checkpoint's tensor, which the embedding, stage 12's sharding and the plain call read) and the
reordered copy comes on top (the model's weights twice in memory on a CPU).

The copy is made at the first product that needs it and made again whenever the weight changes
(another tensor, or the same one written in place): a test that edits a weight, or a model moved
to another dtype, never reads a stale copy. The results agree with ``F.linear`` to rounding
(another order of the same additions), which the tests against ``transformers`` cover.
Elsewhere (a GPU, a CPU without oneDNN's x86 kernels) ``linear`` is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_PREPACKED_ROWS = 4  # fewer rows: the plain call is faster (see above)
PACKED_FOR_ROWS = 128  # the batch size oneDNN picks its blocked layout for


def prepacking_available() -> bool:
    """oneDNN's prepacked linear is in this build of torch and the CPU is an x86 one it has kernels for."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    )


PREPACKING = prepacking_available()  # a fact about this machine and this build of torch, checked once
_linear_pointwise = torch.ops.mkldnn._linear_pointwise if PREPACKING else None  # looked up once, not per call


def linear_kind(device: torch.device) -> str:
    """How this model's matrix products run on ``device`` (for an engine's describe())."""
    if device.type == "cpu" and PREPACKING:
        return f"oneDNN with prepacked weights from {MIN_PREPACKED_ROWS} rows, F.linear below"
    return "F.linear"


class PackedWeight:
    """The reordered copy of one weight, made when first needed and again when the weight changes."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.source: torch.Tensor | None = None  # the weight it was made from
        self.version = -1  # and that weight's version then (in-place writes count up)

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        # An inference tensor (made under torch.inference_mode) keeps no version count: -1.
        version = -1 if weight.is_inference() else weight._version
        if self.packed is None or weight is not self.source or version != self.version:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)
            self.source, self.version = weight, version
        return self.packed


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` when x is [rows, in] on a CPU with at
    least MIN_PREPACKED_ROWS rows and oneDNN can run it. (Called for every product of every
    pass: the checks are the cheap ones first.) Code that torch.compile traces gets F.linear:
    Inductor lays out the weights of the products it compiles itself."""
    if (
        PREPACKING
        and packed is not None
        and x.is_cpu
        and x.dim() == 2
        and x.shape[0] >= MIN_PREPACKED_ROWS
        and not torch.compiler.is_compiling()
    ):
        return _linear_pointwise(x, packed.of(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and checkpoint names) whose CPU products use a prepacked weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
