"""Which waiting request goes first: FCFS, or the longest cached prefix first (LPM).

With a prefix cache the order matters: a request whose prompt is mostly cached costs little
prefill and little memory, and running it soon keeps its prefix hot (recently used nodes are the
last evicted). LPM sorts the queue by the length ``match_prefix`` finds, longest first, ties in
their current queue order. Sorting asks the tree once per waiting request, so on a long queue it
falls back to FCFS (SGLang does the same above 128 waiting requests). Unlike FCFS, LPM can make a
request with nothing cached wait behind a stream of cache hits: that is its price.
"""

from __future__ import annotations

from collections import deque

from s02_request_and_sampling.req import Req
from s05_continuous_batching.prefix_cache import PrefixCache

POLICIES = ("lpm", "fcfs")
LPM_FALLBACK_QUEUE_LEN = 128  # longer queues are served FCFS: sorting them costs too much


class SchedulePolicy:
    def __init__(self, policy: str, prefix_cache: PrefixCache, fallback_queue_len: int = LPM_FALLBACK_QUEUE_LEN):
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; choose one of {POLICIES}")
        self.policy, self.prefix_cache, self.fallback_queue_len = policy, prefix_cache, fallback_queue_len

    def calc_priority(self, waiting: deque[Req]) -> None:
        """Reorder ``waiting`` in place: the first is the next to be admitted."""
        if self.policy == "fcfs" or len(waiting) > self.fallback_queue_len:
            return
        # What admission will match (req.max_prefix_len); sorted() is stable: ties keep their queue order.
        cached = {
            id(req): self.prefix_cache.match_prefix(req.fill_ids[: req.max_prefix_len]).cached_len for req in waiting
        }
        ordered = sorted(waiting, key=lambda req: -cached[id(req)])
        waiting.clear()
        waiting.extend(ordered)
