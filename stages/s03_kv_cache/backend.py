"""``KVCacheBackend``: attention that stores each request's new K/V in its ``KVCache`` and
attends over everything that cache holds.

For request i of the batch, the new tokens sit at positions [prefix_len, seq_len) of its
sequence. Per layer the backend

    1. writes their k, v into cache.k[layer, prefix_len:seq_len] (and .v),
    2. attends the new queries over cache.k[layer, :seq_len]: the stored prefix plus them.

A prefill is prefix_len = 0 with the whole prompt; a decode step is one new token with
prefix_len = seq_len - 1. The same code serves both, and any split in between.
"""

from __future__ import annotations

from typing import Sequence

import torch

from s00_foundation.attention import AttentionBackend, causal_attention  # noqa: F401

from .kv_cache import KVCache


class KVCacheBackend(AttentionBackend):
    def __init__(self, caches: Sequence[KVCache]):
        """One cache per request of the batches this backend will see, in batch order."""
        self.caches = list(caches)

    def forward(self, q, k, v, layer_id, batch):
        if batch.num_reqs != len(self.caches):
            raise ValueError(f"the batch has {batch.num_reqs} requests but the backend holds {len(self.caches)} caches")
        outputs: list[torch.Tensor] = []  # each request's attention output, in batch order
        start = 0
        for i, (cache, prefix_len, seq_len) in enumerate(zip(self.caches, batch.prefix_lens, batch.seq_lens)):
            # The new tokens must continue exactly where the cache ends: a gap would leave
            # positions nobody wrote, an overlap would overwrite K/V that are already final.
            if prefix_len != cache.seq_len:
                raise ValueError(
                    f"request {i}: the batch says {prefix_len} tokens are cached (its prefix_lens), the cache holds "
                    f"{cache.seq_len}: the new tokens' positions start at the cache's seq_len"
                )
            if seq_len > cache.capacity:
                raise ValueError(
                    f"request {i}: {seq_len} positions do not fit a cache of capacity {cache.capacity}; "
                    "call cache.reserve(seq_len) before the forward pass"
                )
            end = start + (seq_len - prefix_len)  # noqa: F841
            raise NotImplementedError(
                "Stage 3: store this request's new K/V in its cache, then attend over the whole cache - see stages/s03_kv_cache/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
            )
        return torch.cat(outputs, dim=0)
