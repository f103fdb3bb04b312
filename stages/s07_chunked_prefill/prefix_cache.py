"""Prefix caches that can hold a request's K/V while it is still being prefilled.

Stage 5's protocol only hears from a request when it leaves (``cache_finished_req``). A chunked
prefill stops half way and goes on in the next step, so the cache gets one more call after each
chunk (SGLang's name and contract)::

    cache_unfinished_req(token_ids, slots, match) -> PrefixMatch
        the request computed token_ids so far (slots[i] holds token_ids[i]); it keeps running.
        Returns its new match: the prefix the cache now holds for it, locked for it; the request
        keeps owning the slots after that prefix.

``ChunkedRadixCache`` inserts the finished chunks into the tree right away, so another request with
the same prefix can reuse them before the long prompt is even done, and a retracted chunked
request finds them again. ``ChunkCache`` is SGLang's name for the no-sharing cache used when the
radix cache is off: the request simply keeps its slots.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from s05_continuous_batching.prefix_cache import NoPrefixCache, PrefixCache, PrefixMatch
from s06_radix_cache.radix_cache import RadixCache, check_present_covers_match  # noqa: F401


class ChunkedPrefixCache(PrefixCache, Protocol):
    """Stage 5's protocol plus the call after each chunk (the module docstring)."""

    def cache_unfinished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, match: PrefixMatch
    ) -> PrefixMatch: ...


class ChunkCache(NoPrefixCache):
    """Stage 5's cache that caches nothing, plus the one call chunked prefill needs."""

    def cache_unfinished_req(self, token_ids: Sequence[int], slots: torch.Tensor, match: PrefixMatch) -> PrefixMatch:
        return match  # nothing is shared: the request keeps every slot it computed


class ChunkedRadixCache(RadixCache):
    """Stage 6's radix tree, which also takes a chunked request's finished chunks."""

    def cache_unfinished_req(self, token_ids: Sequence[int], slots: torch.Tensor, match: PrefixMatch) -> PrefixMatch:
        """Insert what the request computed so far (its whole pages) and hand it the tree's copy:
        slots of tokens the tree already held are duplicates and are freed; the returned match
        covers the inserted prefix, is locked, and replaces ``match`` (unlocked)."""
        if len(slots) != len(token_ids):
            raise ValueError(f"cache_unfinished_req got {len(token_ids)} tokens but {len(slots)} slots")
        raise NotImplementedError(
            "Stage 7: insert a half-prefilled request's chunks and hand it the tree's copy - see stages/s07_chunked_prefill/README.md#the-half-prefilled-request-chunked_req"  # noqa: E501 (one message, the learner's to read whole)
        )
