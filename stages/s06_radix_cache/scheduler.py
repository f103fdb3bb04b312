"""``RadixScheduler``: stage 5's scheduler with a radix cache behind its prefix-cache seam.

Stage 5 already asks the prefix cache before admitting and hands every leaving request's K/V
to it; with a ``RadixCache`` plugged in three things change here:

- the waiting queue is ordered by a ``SchedulePolicy`` (longest cached prefix first, or FCFS)
  before each admission;
- the room a request may use is counted *with its matched prefix locked*: the matched slots are
  evictable until the request locks them, and must not be counted as free room for its own prefill;
- every leaving request keeps its K/V in the tree, retracted (and aborted) ones too: the slots
  hold valid K/V whatever the reason it left, and a retracted request readmitted later finds
  its own prefix there and recomputes only what was evicted meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

from s02_request_and_sampling.req import Req
from s04_paged_kv_pool.allocator import pages_for
from s05_continuous_batching.prefix_cache import PrefixMatch
from s05_continuous_batching.scheduler import Scheduler, SchedulerStats
from s05_continuous_batching.schedule_batch import slots_to_extend

from .schedule_policy import SchedulePolicy


@dataclass
class RadixSchedulerStats(SchedulerStats):
    cached_tokens: int = 0  # prompt tokens admitted requests found in the cache (not computed)


class RadixScheduler(Scheduler):
    def __init__(self, runner, prefix_cache, schedule_policy: str = "lpm", **knobs):
        """``knobs``: stage 5's (max_prefill_tokens, new_token_ratio, on_step, clock)."""
        super().__init__(runner, prefix_cache, **knobs)
        self.policy = SchedulePolicy(schedule_policy, self.prefix_cache)
        self.stats = RadixSchedulerStats()

    def start_req(self, req: Req, match: PrefixMatch) -> None:
        super().start_req(req, match)
        self.stats.cached_tokens += match.cached_len

    def release_req(self, req: Req, insert: bool) -> None:
        super().release_req(req, insert=True)  # see the module docstring: every leaver's K/V is kept

    def admit_new_requests(self) -> list[Req]:
        """Stage 5's admission under the same budgets, in the policy's order, with each candidate's
        matched prefix locked while its room is counted."""
        self.policy.calc_priority(self.waiting)
        admitted: list[Req] = []
        reserved = sum(slots_to_extend(req, self.page_size) + self.future_slots(req) for req in self.running)
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_running_requests:
            req = self.waiting[0]
            match = self.prefix_cache.match_prefix(req.fill_ids[:-1])  # at least one token is computed
            extend_len = req.device_len - match.cached_len
            if admitted and extend_len > budget:
                break
            prefill_slots = (pages_for(req.device_len, self.page_size) - pages_for(match.cached_len, self.page_size)) * self.page_size
            need = prefill_slots + self.future_slots(req)
            self.prefix_cache.lock(match)  # its own prefix is not room it could evict for itself
            room = self.available_slots() - reserved
            self.prefix_cache.unlock(match)
            first_alone = not self.running and not admitted
            if need > room and not (first_alone and prefill_slots <= room):
                break
            self.waiting.popleft()
            self.start_req(req, match)
            admitted.append(req)
            budget -= extend_len
            reserved += need
        return admitted
