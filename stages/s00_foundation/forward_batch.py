"""The explicit batch object handed to the model on every forward pass.

SGLang's rule, kept here from stage 1 on: nothing about the current batch lives in a global.
The scheduler builds a ``ForwardBatch`` (which tokens, at which positions, for which requests,
and where their K/V go), the model threads it through every layer, and the attention backend
reads what it needs from it.

Tokens of all requests are flattened into one ragged row ``[T]`` (no padding): request ``i``
contributes ``extend_lens[i]`` new tokens whose positions continue after its ``prefix_lens[i]``
already-cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .attention.backend import AttentionBackend


class ForwardMode(Enum):
    EXTEND = "extend"  # at least one request sends several new tokens (a prefill or a chunk of one)
    DECODE = "decode"  # every request sends exactly one new token


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: the new tokens of every request, concatenated
    positions: torch.Tensor  # [T] int64: each new token's position in its own sequence
    extend_lens: list[int]  # per request: new tokens in this pass (1 for a decode)
    seq_lens: list[int]  # per request: tokens in context after this pass (cached + new)
    attn_backend: "AttentionBackend"
    # Filled from stage 4 on, where K/V live in a shared pool:
    req_pool_indices: torch.Tensor | None = None  # [num_reqs] row of each request in the ReqToTokenPool
    out_cache_loc: torch.Tensor | None = None  # [T] the pool slot each new token's K/V is written to

    @property
    def num_reqs(self) -> int:
        return len(self.extend_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens)]

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.DECODE if all(e == 1 for e in self.extend_lens) else ForwardMode.EXTEND

    @classmethod
    def build(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        attn_backend: "AttentionBackend",
        device: torch.device | str = "cpu",
        **extra,
    ) -> "ForwardBatch":
        """A batch from each request's new tokens and how many of its tokens are already cached."""
        if len(new_token_ids) != len(prefix_lens):
            raise ValueError(f"{len(new_token_ids)} requests but {len(prefix_lens)} prefix lengths")
        if any(len(ids) == 0 for ids in new_token_ids):
            raise ValueError("every request in a forward batch needs at least one new token")
        flat = [t for ids in new_token_ids for t in ids]
        positions = [p + i for ids, p in zip(new_token_ids, prefix_lens) for i in range(len(ids))]
        extend_lens = [len(ids) for ids in new_token_ids]
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            extend_lens=extend_lens,
            seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens)],
            attn_backend=attn_backend,
            **extra,
        )
