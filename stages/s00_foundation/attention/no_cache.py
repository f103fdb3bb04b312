"""The backend with no cache at all: every pass must carry each request's whole sequence."""

from __future__ import annotations

import torch

from .backend import AttentionBackend, causal_attention


class NoCacheBackend(AttentionBackend):
    def forward(self, q, k, v, layer_id, batch):
        if any(batch.prefix_lens):
            raise ValueError(
                "NoCacheBackend keeps no K/V, so each request must send its whole sequence "
                f"(prefix lengths must be 0, got {batch.prefix_lens})"
            )
        outputs, start = [], 0
        for n in batch.extend_lens:
            outputs.append(causal_attention(q[start : start + n], k[start : start + n], v[start : start + n]))
            start += n
        return torch.cat(outputs, dim=0)
