"""The two memory pools of SGLang's design: ``ReqToTokenPool`` and ``TokenToKVPool``.

Stage 3 gave every request its own contiguous cache, sized for its longest possible output.
Here all K/V of all requests live in ONE pool allocated up front, as a flat array of slots;
a request's tokens may sit in any slots, and a table says which::

    ReqToTokenPool.req_to_token  [max_reqs, max_context_len]   row r, position j -> slot
    TokenToKVPool.k_buffer[layer] [num_slots, kv_heads, head_dim]   slot -> K of that token
    TokenToKVPool.v_buffer[layer] [num_slots, kv_heads, head_dim]   slot -> V of that token

    request A (row 0): positions 0 1 2 3 4      -> slots 1 2 3 7 8
    request B (row 1): positions 0 1 2          -> slots 4 5 6

Slot 0 (page 0 when pages hold several slots) is never handed out: it is a dummy that padded
tokens may write to harmlessly (stage 8 pads decode batches to fixed sizes).
Which slots are free is the allocator's business (allocator.py), not the pool's.
"""

from __future__ import annotations

import torch

from s00_foundation.model import CausalLM


class PoolExhaustedError(RuntimeError):
    """A pool cannot hand out what was asked; nothing was allocated."""


class ReqToTokenPool:
    """Rows of slot indices, one row per running request (``req_pool_idx``)."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu"):
        if size < 1 or max_context_len < 1:
            raise ValueError(
                f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, got {size} and {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.free_slots: list[int] = list(range(size))  # free rows (SGLang's name)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> list[int]:
        """Rows for ``need_size`` new requests."""
        if need_size > len(self.free_slots):
            raise PoolExhaustedError(
                f"ReqToTokenPool: {need_size} request rows asked for, {len(self.free_slots)} of {self.size} free; "
                "raise max_running_requests or run fewer requests at once"
            )
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"ReqToTokenPool: row {row} does not exist (rows are 0..{self.size - 1})")
        if row in self.free_slots:
            raise ValueError(f"ReqToTokenPool: row {row} is already free (double free of a request row)")
        self.free_slots.append(row)


class TokenToKVPool:
    """K and V of every layer for ``size`` usable slots, plus the reserved dummy page."""

    def __init__(
        self,
        size: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.size, self.page_size = size, page_size
        self.num_slots = size + page_size  # slot 0's page is the dummy
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model: CausalLM, size: int, page_size: int = 1) -> "TokenToKVPool":
        c = model.config
        return cls(size, page_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, model.dtype, model.device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k_buffer + self.v_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of token i (k[i], v[i]) in slot loc[i] of this layer."""
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v
