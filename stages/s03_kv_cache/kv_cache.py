"""``KVCache``: the keys and values of ONE request, for every layer, in one contiguous buffer.

Why storing them is safe: position i's K_i and V_i are projections of the hidden state h_i,
and causal attention makes h_i depend only on tokens 0..i. Tokens generated later can never
change them, so once written they are final (RoPE is applied before the write and depends only
on i too). Each step therefore only has to compute K/V for its new tokens and append them.

Layout, per request::

    k, v: [num_layers, capacity, num_kv_heads, head_dim]
          positions [0, seq_len) hold K/V of the tokens seen so far; the rest is free room

The buffer is either preallocated for the whole generation (prompt + max_new_tokens - 1
positions: the last generated token is never stored) or grown
by doubling when it runs out, which copies the stored positions into a buffer twice the size
(amortised O(1) per token, like a Python list).
"""

from __future__ import annotations

import torch

from s00_foundation.model import CausalLM


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if capacity < 1:
            raise ValueError(f"a KV cache needs a capacity of at least 1 position, got {capacity}")
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.seq_len = 0  # positions [0, seq_len) of every layer hold K/V; the rest is room

    @classmethod
    def for_model(cls, model: CausalLM, capacity: int) -> "KVCache":
        """An empty cache shaped for ``model`` (its layers, KV heads, head size, dtype, device)."""
        c = model.config
        return cls(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity, model.dtype, model.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self, length: int) -> None:
        """Make room for positions [0, length), keeping every stored position."""
        if length <= self.capacity:
            return
        raise NotImplementedError(
            "Stage 3: grow the cache until `length` fits, keeping what it holds - see stages/s03_kv_cache/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
        )

    def __repr__(self) -> str:
        return f"KVCache(seq_len={self.seq_len}, capacity={self.capacity}, {self.nbytes / 2**20:.1f} MiB)"
