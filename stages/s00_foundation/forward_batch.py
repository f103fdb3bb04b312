"""The explicit batch object handed to the model on every forward pass.

SGLang's rule, kept here from stage 1 on: nothing about the current batch lives in a global.
The scheduler builds a ``ForwardBatch`` (which tokens, at which positions, for which requests,
and where their K/V go), the model threads it through every layer, and the attention backend
reads what it needs from it.

Tokens of all requests are flattened into one ragged row ``[T]`` (no padding): request ``i``
contributes ``extend_lens[i]`` new tokens whose positions continue after its ``prefix_lens[i]``
already-cached tokens.

Its ``forward_mode`` says what kind of pass it is, decided once when the batch is built, so an
attention backend picks its path from the batch itself (SGLang's ``ForwardBatch.forward_mode``):

    DECODE  every request sends one token                     [a | b | c | d]
    MIXED   the running requests' decodes first, then extends [a | b | E0 E1 E2 E3 | F0 F1]
    EXTEND  anything else: prefills, chunks of a prompt       [E0 E1 E2 | F0 F1 F2 F3]

The small per-step tensors (token ids, positions, table rows) go to the device together, in
one copy from pinned host memory that does not make the host wait (``device.host_to_device``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Sequence

import torch

from .device import host_to_device

if TYPE_CHECKING:
    from .attention.backend import AttentionBackend


class ForwardMode(Enum):
    EXTEND = "extend"  # prefills or chunks of prompts (the first request sends several new tokens)
    DECODE = "decode"  # every request sends exactly one new token
    MIXED = "mixed"  # one-token requests (decodes) first, then requests with several new tokens

    @classmethod
    def of(cls, extend_lens: Sequence[int]) -> "ForwardMode":
        if all(e == 1 for e in extend_lens):
            return cls.DECODE
        return cls.MIXED if extend_lens[0] == 1 else cls.EXTEND


def leading_decodes(extend_lens: Sequence[int]) -> int:
    """How many requests at the front of a batch send exactly one token (all of a DECODE batch,
    the decode part of a MIXED one, none of an EXTEND one)."""
    return next((i for i, e in enumerate(extend_lens) if e != 1), len(extend_lens))


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
    forward_mode: ForwardMode | None = None  # None: from extend_lens (ForwardMode.of)
    # Rows of [T] whose logits the pass returns too, after every request's last token's: the
    # prompt positions of requests that asked for their prompt's log-probabilities (stage 2's
    # prompt_logprobs.py). Empty for almost every pass.
    extra_logit_rows: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.forward_mode is None:
            self.forward_mode = ForwardMode.of(self.extend_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.extend_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens)]

    @classmethod
    def build(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        attn_backend: "AttentionBackend",
        device: torch.device | str = "cpu",
        **extra,
    ) -> "ForwardBatch":
        """A batch from each request's new tokens and how many of its tokens are already cached.

        ``req_pool_indices`` may come in ``extra`` as a list of table rows: it then travels to the
        device in the same single copy as the token ids and positions."""
        if len(new_token_ids) != len(prefix_lens):
            raise ValueError(f"{len(new_token_ids)} requests but {len(prefix_lens)} prefix lengths")
        empty = [i for i, ids in enumerate(new_token_ids) if len(ids) == 0]
        if empty:
            raise ValueError(
                f"every request in a forward batch needs at least one new token; the request(s) at position(s) "
                f"{empty[:8]} of this batch of {len(new_token_ids)} have none: did the scheduler give a request a "
                "pass of 0 tokens (a prefill cut to nothing by what was left of the step's budget, say)?"
            )
        flat = [t for ids in new_token_ids for t in ids]
        positions = [p + i for ids, p in zip(new_token_ids, prefix_lens) for i in range(len(ids))]
        extend_lens = [len(ids) for ids in new_token_ids]
        rows = extra.pop("req_pool_indices", None)
        rows_from_host = isinstance(rows, (list, tuple))
        packed = host_to_device(flat + positions + (list(rows) if rows_from_host else []), device, torch.int64)
        t = len(flat)
        if rows_from_host:
            rows = packed[2 * t :]
        return cls(
            input_ids=packed[:t],
            positions=packed[t : 2 * t],
            extend_lens=extend_lens,
            seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens)],
            attn_backend=attn_backend,
            req_pool_indices=rows,
            **extra,
        )
