"""Greedy generation with a KV cache: prefill the prompt once, then one token per step.

    prefill:  [p0 p1 ... pn-1]  -> K/V of n positions stored, logits for token n
    decode:   [t0] at position n      -> 1 more position stored, logits for token n+1
    decode:   [t1] at position n+1    -> ...

Each decode step computes one token's projections and MLP (a fixed cost: every weight read
once) and attends one query over the n + t cached positions, where stage 1's step redid all of
them: over N tokens the matmuls go from O(N^2) to O(N), attention from O(N^3) to O(N^2).

The last generated token is returned but never fed back (nothing would read its K/V), so after
every step the cache holds exactly len(prompt) + len(generated) - 1 positions.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from s00_foundation.forward_batch import ForwardBatch  # noqa: F401
from s00_foundation.model import CausalLM

from .backend import KVCacheBackend  # noqa: F401
from .kv_cache import KVCache


def extend(model: CausalLM, caches: Sequence[KVCache], new_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Run each request's new tokens after what its cache already holds, in one forward pass.

    Request i's tokens take positions [caches[i].seq_len, caches[i].seq_len + len(new_token_ids[i]));
    their K/V are added to caches[i]. Returns float32 logits [num_reqs, vocab] for the token that
    follows each request's last new token.
    """
    if len(caches) != len(new_token_ids):
        raise ValueError(f"{len(caches)} caches but {len(new_token_ids)} lists of new tokens")
    raise NotImplementedError(
        "Stage 3: run new tokens of every request against its cache - see stages/s03_kv_cache/README.md#what-you-write"
    )


def stream_generate(
    model: CausalLM,
    input_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    cache: KVCache | None = None,
) -> Iterator[int]:
    """Yield the greedy continuation of ``input_ids`` one token at a time (same stopping rule as
    stage 1: at most ``max_new_tokens``, ending with an EOS id if one is produced).

    Without ``cache`` one is preallocated for the whole generation. A given cache must be empty;
    it is left holding the K/V of every token but the last one yielded.
    """
    if not input_ids:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if cache is None:
        # Every position but the last generated token's is written: allocate exactly that.
        cache = KVCache.for_model(model, capacity=len(input_ids) + max_new_tokens - 1)
    elif cache.seq_len != 0:
        raise ValueError(f"the cache already holds {cache.seq_len} positions; generation needs an empty one")
    raise NotImplementedError(
        "Stage 3: prefill once, then decode one token per step - see stages/s03_kv_cache/README.md#what-you-write"
    )
    yield  # keeps stream_generate a generator until you write it; delete this line then


def cached_generate(
    model: CausalLM,
    input_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    cache: KVCache | None = None,
) -> list[int]:
    """Stage 1's ``naive_generate`` contract (greedy, EOS kept), computed with a KV cache."""
    return list(stream_generate(model, input_ids, max_new_tokens, eos_token_ids, cache))
