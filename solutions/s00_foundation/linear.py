"""Linear layers whose weights are reordered once for the CPU's matrix-product library.

``y = x W^T`` on a CPU runs in a GEMM library, and a GEMM kernel does not read ``W`` as it is
stored: it reads it in blocks, laid out for its vector registers and caches. A plain call
(``F.linear``, MKL underneath) lays those blocks out anew on every call; oneDNN (PyTorch's other
CPU library, the one vLLM's CPU build uses for the same purpose) can take a weight that was
reordered into its blocked layout once, ahead of time ("prepacked"). A decode step multiplies a
few rows by every weight of the model, so the per-call layout work is a large share of it.

Measured on an Intel Xeon (SmolLM2-135M's shape, float32, one bare model pass, 1 torch thread):
4 rows 91 -> 60 ms, 8 rows 119 -> 71, 16 rows 110 -> 85, 32 rows 133 -> 111, 64 rows 176 -> 160,
128 rows 275 -> 250; with 2 threads 6-18% less. There, for one to three rows the plain call is
faster (a single row: 52 ms against 60), so those keep it. MKL picks its kernels by the CPU's
vendor, and on an AMD EPYC (Zen 4) its products of one to three rows are slow: they read the
model's weights at 4-10 GB/s, oneDNN's at 10-19 (1 and 2 threads). There a decode step
(``runner.forward``, 2 threads) of 1, 2 and 3 requests took 67, 116 and 141 ms with F.linear and
41, 51 and 39 ms with oneDNN, and a served stream's inter-token latency went from 63-73 ms to
39-41 ms (three streams at once: 144-153 -> 39-43 ms). So on any CPU but an Intel one every
product is prepacked (``min_prepacked_rows``). Every weight is kept as it is (the checkpoint's
tensor, which the embedding, stage 12's sharding and the plain call read) and the reordered copy
comes on top (the model's weights twice in memory on a CPU).

The copy is made at the first product that needs it, or with all the others by
``prepack(model)``, which stage 8's runner calls when an engine starts (otherwise a server's first
request waits for them: SmolLM2-135M, 0.5 s of reordering and 0.15 s of stacking). It is made
again whenever the weight changes (another tensor, or the same one written in place): a test that
edits a weight, or a model moved to another dtype, never reads a stale copy. The results agree
with ``F.linear`` to rounding (another order of the same additions), which the tests against
``transformers`` cover. Elsewhere (a GPU, a CPU without oneDNN's x86 kernels) ``linear`` is
``F.linear``.

Products that read the same input (an attention layer's q, k and v; an MLP's gate and up) run as
one (``linear_group``): their weights stacked in one prepacked copy, the result split back. One
larger product keeps oneDNN's kernels busier than several small ones: a bare model pass, 2
threads, 16 rows 55.0 -> 52.3 ms, 64 rows 103.8 -> 100.7, 128 rows 159.4 -> 154.3.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .device import cpu_vendor

PACKED_FOR_ROWS = 128  # the batch size oneDNN picks its blocked layout for


def min_prepacked_rows(vendor: str) -> int:
    """The fewest rows a product takes oneDNN's prepacked path for, on a CPU of ``vendor`` (as
    ``cpu_vendor()`` reads it): below 4 rows MKL is faster on an Intel CPU (or one whose vendor
    is unknown), and slower at every size on others (see above)."""
    return 4 if vendor in ("GenuineIntel", "") else 1


def prepacking_available() -> bool:
    """oneDNN's prepacked linear is in this build of torch and the CPU is an x86 one it has kernels for."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    )


PREPACKING = prepacking_available()  # a fact about this machine and this build of torch, checked once
MIN_PREPACKED_ROWS = min_prepacked_rows(cpu_vendor())  # fewer rows: the plain call (see above)
_linear_pointwise = torch.ops.mkldnn._linear_pointwise if PREPACKING else None  # looked up once, not per call


def linear_kind(device: torch.device) -> str:
    """How this model's matrix products run on ``device`` (for an engine's describe())."""
    if device.type == "cpu" and PREPACKING:
        if MIN_PREPACKED_ROWS == 1:
            return "oneDNN with prepacked weights (MKL's F.linear is slower on this CPU at every size)"
        return f"oneDNN with prepacked weights from {MIN_PREPACKED_ROWS} rows, F.linear below"
    return "F.linear"


class PackedWeight:
    """The reordered copy of one weight (or of several stacked, see ``linear_group``), made when
    first needed and again when any of them changes."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.sources: tuple[torch.Tensor, ...] = ()  # the weights it was made from
        self.versions: tuple[int, ...] = ()  # and their versions then (in-place writes count up)

    def of(self, *weights: torch.Tensor) -> torch.Tensor:
        # An inference tensor (made under torch.inference_mode) keeps no version count: -1.
        versions = tuple(-1 if w.is_inference() else w._version for w in weights)
        fresh = len(weights) == len(self.sources) and all(w is s for w, s in zip(weights, self.sources))
        if self.packed is None or not fresh or versions != self.versions:
            stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(stacked.detach(), PACKED_FOR_ROWS)
            self.sources, self.versions = weights, versions
        return self.packed


def takes_prepacked_path(x: torch.Tensor) -> bool:
    """A product of ``x`` runs through oneDNN's prepacked weights: x is [rows, in] on a CPU with
    at least MIN_PREPACKED_ROWS rows, oneDNN can run it, and no torch.compile is tracing (Inductor
    lays out the weights of the products it compiles itself). The cheap checks first: this is
    asked for every product of every pass."""
    return (
        PREPACKING
        and x.is_cpu
        and x.dim() == 2
        and x.shape[0] >= MIN_PREPACKED_ROWS
        and not torch.compiler.is_compiling()
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` where ``takes_prepacked_path(x)``."""
    if packed is not None and takes_prepacked_path(x):
        return _linear_pointwise(x, packed.of(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and checkpoint names) whose CPU products use a prepacked weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def linear_group(x: torch.Tensor, layers: Sequence[Linear], packed: PackedWeight) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]`` for products that read the same input, as ONE product
    where ``takes_prepacked_path(x)``: the weights stacked in ``packed``'s copy, the result split
    back (views of it). The layers keep their own parameters and checkpoint names; stage 12 stacks
    the tensors themselves when it loads them, one shard of each per rank."""
    if not takes_prepacked_path(x):
        return [layer(x) for layer in layers]
    weights = [layer.weight for layer in layers]
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    out = _linear_pointwise(x, packed.of(*weights), bias, "none", [], "")
    return list(out.split([w.shape[0] for w in weights], dim=-1))


def prepack(model: nn.Module) -> int:
    """Make now every prepacked copy the model's CPU products will read (each block that has some
    lists them: ``packed_products()``), instead of in the first pass that needs each. Returns how
    many copies it made; none where oneDNN's prepacked path does not run (a GPU, no oneDNN)."""
    if not PREPACKING:
        return 0
    made = 0
    for module in model.modules():
        for packed, weights in getattr(module, "packed_products", list)():
            if weights[0].is_cpu:
                packed.of(*weights)
                made += 1
    return made
