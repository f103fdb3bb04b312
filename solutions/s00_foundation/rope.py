"""Rotary position embeddings (RoPE), with the scaling variants Llama-family configs use.

Each pair of channels (i, i + d/2) of q and k is rotated by the angle ``position * inv_freq[i]``.
Because the angle depends only on the absolute position, a token's rotated K never changes once
written, which is exactly what lets later stages cache K and reuse it.
"""

from __future__ import annotations

import math

import torch

from . import cpu_ops
from .config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-channel-pair frequencies, float32, on the CPU (computed the way transformers does).

    Explicitly on the CPU: the loader builds the model under a ``meta`` device context.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    raise ValueError(f"RoPE scaling {rope_type!r} is not supported (supported: default, linear, llama3).")


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """Turns positions into (cos, sin) tables; holds no weights, so it is not an nn.Module."""

    def __init__(self, config: ModelConfig):
        self.inv_freq_cpu = inv_frequencies(config)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on.setdefault(positions.device, self.inv_freq_cpu.to(positions.device))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2], always float32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] by the per-token angles in ``cos``/``sin`` [T, D]."""
    if cpu_ops.applies(x):  # a CPU pass: the same products and sums in one loop (cpu_ops.py)
        return cpu_ops.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
