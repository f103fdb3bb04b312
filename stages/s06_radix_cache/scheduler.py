"""``RadixScheduler``: stage 5's scheduler with a radix cache behind its prefix-cache seam.

Stage 5 already asks the prefix cache before admitting (counting a request's room with its
matched prefix locked, so its own cached slots are not mistaken for room it could evict) and
hands every leaving request's K/V to it; with a ``RadixCache`` plugged in two things change here:

- the waiting queue is ordered by a ``SchedulePolicy`` (longest cached prefix first, or FCFS)
  before each admission;
- every leaving request keeps its K/V in the tree, retracted (and aborted) ones too
  (``keep_kv_of``): the slots hold valid K/V whatever the reason it left, and a retracted
  request readmitted later finds its own prefix there and recomputes only what was evicted
  meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from s02_request_and_sampling.req import Req
from s05_continuous_batching.prefix_cache import PrefixMatch
from s05_continuous_batching.scheduler import LeaveReason, Scheduler, SchedulerStats

from .schedule_policy import SchedulePolicy


@dataclass
class RadixSchedulerStats(SchedulerStats):
    cached_tokens: int = 0  # prompt tokens admitted requests found in the cache (not computed)


class RadixScheduler(Scheduler):
    keep_kv_of: frozenset[LeaveReason] = frozenset(
        {"finished", "retracted", "aborted"}
    )  # the module docstring says why
    stats: RadixSchedulerStats

    def __init__(self, runner, prefix_cache, schedule_policy: str = "lpm", **knobs):
        """``knobs``: stage 5's (max_prefill_tokens, new_token_ratio, on_step, clock)."""
        super().__init__(runner, prefix_cache, **knobs)
        self.policy = SchedulePolicy(schedule_policy, self.prefix_cache)
        self.stats = RadixSchedulerStats()

    def start_req(self, req: Req, match: PrefixMatch) -> None:
        super().start_req(req, match)
        self.stats.cached_tokens += match.cached_len

    def admit_new_requests(self, scheduled: Sequence[Req] = (), budget: int | None = None) -> list[Req]:
        """Stage 5's admission, over the queue in the policy's order: the longest cached prefix
        first (or FCFS for a long queue)."""
        self.policy.calc_priority(self.waiting)
        return super().admit_new_requests(scheduled, budget)
