"""The attention backend interface, and the causal attention math every backend shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: "ForwardBatch"
    ) -> torch.Tensor:
        """Attention for the batch's new tokens.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (RoPE already applied),
        for the T new tokens of ``batch`` in its flattened order. Returns [T, num_heads, head_dim].
        A backend with a cache stores k, v first, then attends over the cached prefix plus them.
        """


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention for ONE request whose last ``len(q)`` tokens are the queries.

    q: [n, H, D] for the newest n tokens; k, v: [L, KVH, D] for all L >= n tokens of the
    sequence (cached prefix first). Query i sits at position L - n + i and sees keys 0..L-n+i.
    Grouped-query attention (KVH < H) shares each K/V head among H / KVH query heads.
    """
    n, total = q.shape[0], k.shape[0]
    # [1, heads, tokens, D]: SDPA's fused kernels (flash attention, also on a CPU) take only 4-D
    # inputs; 3-D ones fall back to the math path, which computes every masked score too (5x
    # slower for a 1500-token prompt on a CPU, measured).
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if n == total:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    elif n == 1:
        # A decode step: the one query is the newest token and sees every key (no mask to build).
        # Each K/V head's query heads stand in the query dimension, so the head counts match and
        # no kernel copies K/V once per query head (stage 8's lesson, "Grouped queries").
        kv_heads = k.shape[1]
        grouped = q.reshape(1, kv_heads, q.shape[1] // kv_heads, q.shape[2])
        return F.scaled_dot_product_attention(grouped, kt, vt).reshape(q.shape)
    else:
        # With a cached prefix the mask is "bottom-right aligned": SDPA's is_causal aligns it
        # top-left, which would hide the prefix from the first new token, so spell it out.
        query_pos = torch.arange(total - n, total, device=q.device)[:, None]
        key_pos = torch.arange(total, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=key_pos <= query_pos, enable_gqa=True)
    return out[0].transpose(0, 1)
