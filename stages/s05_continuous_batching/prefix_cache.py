"""The prefix-cache seam: how many leading tokens of a request already have K/V in the pool?

Before admitting a request, the scheduler asks the prefix cache. Whatever is cached does not
have to be computed again, nor does it need new slots: the request's table row simply points at
the slots that already hold it. When a request leaves (finished, aborted or retracted), its K/V
is handed back to the cache, which may keep it for later requests that share the prefix.

This stage plugs in ``NoPrefixCache``: nothing is ever cached, every answer is "0 tokens", and
every slot handed back goes straight to the allocator. Stage 6 plugs in a radix tree behind the
same protocol (SGLang's ``BasePrefixCache``, trimmed to what the scheduler calls):

    match_prefix(token_ids) -> PrefixMatch      leading tokens cached, the slots holding them
    lock(match) / unlock(match)                 while a request reads those slots, never evict them
    cache_finished_req(token_ids, slots, match, insert)
                                                a request leaves; keep its K/V for reuse (insert) or
                                                not; slots not kept go back to the allocator
    evictable_size() -> int                     slots the cache holds that no request uses: the
                                                scheduler counts them as room, since they can be
    evict(num_tokens) -> int                    ... given back to the allocator on demand
    cached_slots() -> Tensor                    every slot the cache holds (invariant checks)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from s04_paged_kv_pool.allocator import TokenToKVPoolAllocator


@dataclass
class PrefixMatch:
    cached_len: int  # leading tokens whose K/V are already in the pool
    slots: torch.Tensor  # int64 [cached_len]: the pool slot of each of those tokens
    node: Any = None  # the cache's own handle on the match (stage 6: a tree node), for lock/unlock


class PrefixCache(Protocol):
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids``. The caller passes at most all but the last
        token of a request: at least one token must be computed to have logits to sample from."""

    def lock(self, match: PrefixMatch) -> None:
        """A running request now reads ``match.slots``: they must not be evicted until unlock."""

    def unlock(self, match: PrefixMatch) -> None:
        """Undo one ``lock``."""

    def cache_finished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, match: PrefixMatch, insert: bool
    ) -> None:
        """A request leaves. ``slots[i]`` holds the K/V of ``token_ids[i]``, and the first
        ``match.cached_len`` of them came from ``match``. With ``insert`` the cache may keep the
        request's K/V for later requests (it then owns those slots); every slot it does not keep
        and did not own before goes back to the allocator. Unlocks ``match``."""

    def evictable_size(self) -> int:
        """Slots the cache holds that no running request reads (free room, on demand)."""

    def evict(self, num_tokens: int) -> int:
        """Give at least ``num_tokens`` evictable slots back to the allocator if it can; returns
        how many it gave back."""

    def cached_slots(self) -> torch.Tensor:
        """Every slot the cache holds right now, locked or not (int64, any order)."""


class NoPrefixCache:
    """The prefix cache that caches nothing: every match is empty and every slot a leaving
    request hands back is freed at once."""

    def __init__(self, allocator: TokenToKVPoolAllocator):
        self.allocator = allocator

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch(0, torch.empty(0, dtype=torch.int64, device=self.allocator.device))

    def lock(self, match: PrefixMatch) -> None:
        pass  # nothing is cached, so nothing can be evicted from under a request

    def unlock(self, match: PrefixMatch) -> None:
        pass

    def cache_finished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, match: PrefixMatch, insert: bool
    ) -> None:
        self.allocator.free(slots)  # keep nothing: the K/V of a leaving request is gone

    def evictable_size(self) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def cached_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)
