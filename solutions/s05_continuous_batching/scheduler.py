"""``Scheduler``: continuous batching - requests join and leave the running batch at every step.

A static batch (stage 4) starts together and ends with its slowest request; a slot freed early
sits idle and newcomers wait for the whole batch. Here the batch is rebuilt every step: retract
(only when the pool is short), admit, build one ragged batch of decodes and prefills, run it,
process its tokens and retire the finished requests at once. The loop's diagram and its five
steps are in this stage's README ("The loop"); ``step()`` below is that loop.

Room is counted in KV slots. Admission keeps some back for the requests already running: the
slots of their next pass plus ``new_token_ratio`` of the tokens they may still generate. With a
ratio of 1 nothing admitted can ever run short (as careful as a static batch); with a lower one
more requests run at once, and when a guess was too low, step 1 repairs it by retracting.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Literal, Sequence

import torch

from s02_request_and_sampling.engine import append_sampled, check_not_stuck
from s02_request_and_sampling.logprobs import TokenLogprob
from s02_request_and_sampling.prompt_logprobs import score_prompts
from s02_request_and_sampling.req import FinishReason, Req, TimeStats
from s04_paged_kv_pool.allocator import pages_for
from s04_paged_kv_pool.memory_pool import PoolExhaustedError
from s04_paged_kv_pool.model_runner import ModelRunner

from .prefix_cache import NoPrefixCache, PrefixCache, PrefixMatch
from .schedule_batch import ScheduleBatch, slots_to_extend
from .servable import check_servable
from .trace import StepTrace

# Why a request leaves the running batch; the prefix cache hears it (see Scheduler.keep_kv_of).
LeaveReason = Literal["finished", "retracted", "aborted"]


@dataclass
class TokenOutput:
    """What one step did for one request: the tokens it gained, and whether it is over."""

    rid: Hashable
    new_token_ids: list[int]
    finish_reason: FinishReason | None  # None while the request goes on
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, if the request asked


@dataclass
class SchedulerStats:
    steps: int = 0  # forward passes run
    peak_running: int = 0  # most requests in one forward pass
    num_retractions: int = 0
    prefill_tokens: int = 0  # tokens computed by prefills (recomputed ones included)
    decode_tokens: int = 0  # tokens computed by decodes


class Scheduler:
    # The policy for a leaver's K/V: the reasons for which the prefix cache may keep it for later
    # requests (cache_finished_req's insert); every other leaver's slots go straight back. Here
    # only a finished request's prompt and answer are offered (NoPrefixCache keeps nothing anyway);
    # stage 6 keeps every leaver's (RadixScheduler).
    keep_kv_of: frozenset[LeaveReason] = frozenset({"finished"})

    def __init__(
        self,
        runner: ModelRunner,
        prefix_cache: PrefixCache | None = None,
        max_prefill_tokens: int = 4096,
        new_token_ratio: float = 0.5,
        on_step: Callable[[StepTrace], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """Schedule requests onto ``runner`` (its pool, allocator and table).

        ``max_prefill_tokens``: prompt tokens admitted per step (a single longer prompt still
        runs, as the only prefill of its step; the running requests' decodes ride along).
        ``new_token_ratio``: the share of each running request's remaining max_new_tokens that
        admission keeps free for it. ``on_step`` receives a ``StepTrace`` after every step
        (``trace.print_trace`` prints it as one line).
        """
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if not 0 <= new_token_ratio <= 1:
            raise ValueError(f"new_token_ratio must be in [0, 1], got {new_token_ratio}")
        self.runner = runner
        self.prefix_cache = prefix_cache if prefix_cache is not None else NoPrefixCache(runner.allocator)
        self.max_prefill_tokens = max_prefill_tokens
        self.new_token_ratio = new_token_ratio
        self.max_running_requests = runner.req_to_token_pool.size  # one table row per running request
        self.on_step = on_step
        self.clock = clock
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in admission order: the newest are retracted first
        self.stats = SchedulerStats()

    # --- requests in and out ----------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self.runner.page_size

    def check_servable(self, req: Req) -> None:
        """Raise RequestTooLong (a ValueError) if ``req`` could never finish here, whatever else runs."""
        runner = self.runner
        check_servable(
            req,
            context=runner.model.config.max_position_embeddings,
            pool=runner.allocator.size,
            table_width=runner.req_to_token_pool.max_context_len,
            page_size=self.page_size,
        )

    def add_request(self, req: Req) -> None:
        """Queue a new request (last in line). Raises ValueError, queueing nothing, if it could
        never be served (see ``check_servable``) or its rid is already in use."""
        if req.output_ids or req.cached_len or req.finished:
            raise ValueError(f"request {req.rid} has already run; add a fresh Req")
        if any(other.rid == req.rid for other in (*self.waiting, *self.reqs_holding_memory())):
            raise ValueError(f"request id {req.rid!r} is already waiting or running; request ids must be unique")
        self.check_servable(req)
        req.time_stats = TimeStats(arrival=self.clock())
        self.waiting.append(req)

    def abort_request(self, rid: Hashable) -> bool:
        """End a waiting or running request now (finish reason "abort"), freeing what it holds.
        Returns False if no such request is waiting or running."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)  # a waiting request holds no memory
                break
        else:
            for req in self.running:
                if req.rid == rid:
                    self.running.remove(req)
                    self.release_req(req, "aborted")
                    break
            else:
                return False
        req.abort()
        req.time_stats.finished = self.clock()
        return True

    def abort_failed_step(self) -> list[Req]:
        """``step()`` raised (a forward pass that failed, a sampler that refused a value): the
        requests holding memory are in an unknown state, so each is ended (finish reason "abort").
        What its bookkeeping vouches for (its positions up to cached_len) goes back through
        abort_request as usual; the slots the failed pass allocated beyond that are orphans, and
        with no request holding memory any more they are easy to find: every allocated page the
        prefix cache does not hold. Waiting requests hold nothing and stay in line. A server calls
        this (stage 9), then check_invariants(): if those fail, nothing can be trusted any more.
        Returns the aborted requests."""
        holders = self.reqs_holding_memory()
        for req in holders:
            if req.req_pool_idx is None:  # it finished, and was released, during the failed pass
                self.running.remove(req)
            else:
                self.abort_request(req.rid)
        self.runner.allocator.free_orphans(self.prefix_cache.cached_slots())
        return holders

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- memory -------------------------------------------------------------------------------------

    def available_slots(self) -> int:
        """Slots a pass could use now: the free ones plus those the prefix cache can evict."""
        return self.runner.allocator.available_size() + self.prefix_cache.evictable_size()

    def next_pass_slots(self, reqs) -> int:
        """Fresh slots the next pass of ``reqs`` takes (one decode token each, in whole pages)."""
        return sum(slots_to_extend(req, self.page_size) for req in reqs)

    def future_slots(self, req: Req) -> int:
        """Slots kept back for what ``req`` may still generate after its next pass:
        ``new_token_ratio`` of its remaining max_new_tokens, in the whole pages those positions
        take past device_len (a running request's next pass ends there; a waiting request's
        device_len is the end of its fill_ids, where its new tokens start even when stage 7
        computes its prompt in chunks). Counted in pages, a ratio of 1 keeps back exactly what it
        will use."""
        remaining = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
        tokens = math.ceil(self.new_token_ratio * max(remaining, 0))
        p = self.page_size
        return (pages_for(req.device_len + tokens, p) - pages_for(req.device_len, p)) * p

    def reserved_slots(self, reqs) -> int:
        """Slots admission keeps back for ``reqs``: their next pass and their future_slots."""
        return self.next_pass_slots(reqs) + sum(self.future_slots(req) for req in reqs)

    def start_req(self, req: Req, match: PrefixMatch) -> None:
        """Give an admitted request a table row whose first ``match.cached_len`` positions point
        at the cached slots (none here); its next pass computes the rest of its fill_ids."""
        if match.cached_len > req.max_prefix_len:  # (the table row below would take the extra slots silently)
            raise ValueError(
                f"request {req.rid}: the prefix cache matched {match.cached_len} tokens, more than the "
                f"{req.max_prefix_len} of its key, fill_ids[:max_prefix_len]: admission matches only that key, since "
                "at least the last token is computed (its logits give the next token), and a match is never longer "
                "than its key (stage 6: where the key leaves an edge in the middle, the edge is split and only its "
                "matched part counts)"
            )
        try:
            [row] = self.runner.req_to_token_pool.alloc(1)
        except PoolExhaustedError as error:  # the pool has max_running_requests rows: admission miscounted
            raise PoolExhaustedError(
                f"{error}. Admission started request {req.rid} with every table row taken: it admits only while the "
                "requests holding a row (reqs_holding_memory()) and those admitted in this step (stage 7: the "
                "half-prefilled request's next chunk among them) are fewer than max_running_requests"
            ) from None
        self.prefix_cache.lock(match)
        self.runner.req_to_token_pool.req_to_token[row, : match.cached_len] = match.slots
        req.req_pool_idx, req.prefix_match, req.cached_len = row, match, match.cached_len
        req.time_stats.scheduled.append(self.clock())

    def release_req(self, req: Req, why: LeaveReason) -> None:
        """A request leaves the running batch (``why``: finished, retracted or aborted): its K/V go
        to the prefix cache, which may keep them when ``why`` is in ``keep_kv_of`` and frees every
        slot it does not keep; its table row is freed. Afterwards it holds nothing:
        req_pool_idx and prefix_match are None, cached_len is 0."""
        # BEGIN EXERCISE: a leaving request gives its K/V to the prefix cache and its row back [#what-you-write]
        row = req.req_pool_idx
        slots = self.runner.req_to_token_pool.req_to_token[row, : req.cached_len].clone()
        insert = why in self.keep_kv_of
        self.prefix_cache.cache_finished_req(req.fill_ids[: req.cached_len], slots, req.prefix_match, insert)
        self.runner.req_to_token_pool.free(row)
        req.req_pool_idx, req.prefix_match, req.cached_len = None, None, 0
        # END EXERCISE

    # --- one step ---------------------------------------------------------------------------------

    def retract_for_decode(self) -> list[Req]:
        """Called when the pool cannot hold the next pass of every running request: retract the
        most recently admitted ones (to the front of the waiting queue) until it can.
        Returns the retracted requests, newest first."""
        retracted: list[Req] = []
        # BEGIN EXERCISE: retract the newest running requests to the front of the queue until the pass fits
        # [#retraction-when-the-pool-runs-dry]
        while len(self.running) > 1 and self.next_pass_slots(self.running) > self.available_slots():
            req = self.running.pop()
            self.release_req(req, "retracted")
            # Retracted several times in one step, the older one must end up first in line:
            # it is popped later, so it is pushed to the front later.
            self.waiting.appendleft(req)
            retracted.append(req)
        return retracted
        # END EXERCISE

    def prefill_len(self, req: Req, cached_len: int, budget: int) -> int:
        """Tokens ``req`` computes in its first pass when ``cached_len`` of them are cached: all the
        rest of its fill_ids (stage 7 cuts a long prompt to the step's ``budget``)."""
        return len(req.fill_ids) - cached_len

    def admit_new_requests(self, scheduled: Sequence[Req] = (), budget: int | None = None) -> list[Req]:
        """Admit waiting requests, first come first served, while the budgets allow: request
        rows (max_running_requests, less those held: reqs_holding_memory), prompt tokens this
        step (``budget``, by default max_prefill_tokens: the first request of a step may exceed
        it, as its only prefill) and pool room, after keeping back what the running requests
        need (their next pass and future_slots).
        If nothing runs, the first in line is admitted whenever its prefill fits, whatever its
        future needs. The first request that does not fit stops admission: no one overtakes
        it, so no one starves. ``scheduled``: requests that already prefill in this pass (stage
        7's half-prefilled request); they count as admitted first, but are not returned. Returns the
        newly admitted requests only (each started with start_req, its device_len set to the end of
        its pass), in order."""
        admitted: list[Req] = list(scheduled)
        reserved = self.reserved_slots([*self.running, *scheduled])
        budget = self.max_prefill_tokens if budget is None else budget
        # BEGIN EXERCISE: admit waiting requests in order under the three budgets
        # [#admission-three-budgets-and-the-room-in-the-pool]
        while self.waiting and len(self.reqs_holding_memory()) + len(admitted) < self.max_running_requests:
            req = self.waiting[0]
            # At least the last token is computed: its logits give the next token (max_prefix_len).
            match = self.prefix_cache.match_prefix(req.fill_ids[: req.max_prefix_len])
            extend_len = self.prefill_len(req, match.cached_len, budget)
            if admitted and extend_len > budget:
                break
            end = match.cached_len + extend_len
            prefill_slots = (
                pages_for(end, self.page_size) - pages_for(match.cached_len, self.page_size)
            ) * self.page_size
            need = prefill_slots + self.future_slots(req)
            # Its own matched prefix is not room it could evict for itself (stage 6's cache holds
            # slots; NoPrefixCache's lock is a no-op): count the room while the match is locked.
            self.prefix_cache.lock(match)
            room = self.available_slots() - reserved
            self.prefix_cache.unlock(match)
            first_alone = not self.running and not admitted
            if need > room and not (first_alone and prefill_slots <= room):
                break
            self.waiting.popleft()
            req.device_len = end  # this pass computes fill_ids[cached_len:end] (all of them, before stage 7)
            self.start_req(req, match)
            admitted.append(req)
            budget -= extend_len
            reserved += need
        return admitted[len(scheduled) :]
        # END EXERCISE

    def process_batch_result(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        """After the forward pass: every request of the batch now has its new tokens' K/V
        stored; each samples one token with its own SamplingParams and checks whether it is
        done. Finished requests are retired at once. Returns the requests that got a token:
        all of them here (stage 7's half-prefilled requests get none until their last chunk)."""
        reqs = batch.reqs
        # BEGIN EXERCISE: sample one token per request, retire the finished ones [#what-you-write]
        for req in reqs:
            req.cached_len = req.device_len
        append_sampled(reqs, logits)
        finished = [req for req in reqs if req.finished]
        for req in finished:
            self.release_req(req, "finished")
        self.running = [req for req in self.running if not req.finished]
        return reqs
        # END EXERCISE

    def check_room_after_retraction(self) -> None:
        """After retract_for_decode: the running requests' next pass must fit, or nothing can run."""
        if self.running and self.next_pass_slots(self.running) > self.available_slots():
            why = (
                "something else holds the pool (a leak?), and retracting cannot help"
                if len(self.running) == 1
                else "retract_for_decode must retract until the others fit"
            )
            raise RuntimeError(
                f"{len(self.running)} request(s) still run (the oldest: {self.running[0].rid}) and their next pass "
                "needs "
                f"{self.next_pass_slots(self.running)} KV slot(s), but only {self.available_slots()} of "
                f"{self.runner.allocator.size} are free: {why}"
            )

    def step(self) -> list[TokenOutput]:
        """One scheduling step and one forward pass (a turn of SGLang's event loop: build the next
        batch, run it, process its result). Returns what each request of the pass got."""
        if not self.has_work:
            return []
        start = self.clock()
        retracted = self.retract_if_short(self.running, start)
        admitted = self.admit_new_requests()
        if not self.running and not admitted:
            raise self.nothing_can_run(self.waiting[0])
        batch = ScheduleBatch(self.runner, self.prefix_cache, decode_reqs=list(self.running), prefill_reqs=admitted)
        prefill_tokens = batch.prefill_tokens
        self.running += admitted  # from here on they hold memory (see abort_failed_step)
        forward_batch = batch.prepare_forward()
        logits = score_prompts(batch.prompt_rows, self.runner.forward(forward_batch))
        sampled = self.process_batch_result(batch, logits)
        check_not_stuck(self.running)
        now = self.clock()
        for req in sampled:
            req.time_stats.got_token(now, req.finished)
        outputs = [
            TokenOutput(req.rid, req.output_ids[-1:], req.finished_reason, req.output_logprobs[-1:]) for req in sampled
        ]
        self.record_step(batch, prefill_tokens, retracted, outputs, (start, now))
        return outputs

    def retract_if_short(self, decodes: Sequence[Req], now: float) -> list[Req]:
        """Retract (``retract_for_decode``) when the next pass of ``decodes`` would not fit the
        free slots, check that it fits then, and count it. Returns the retracted requests."""
        if self.next_pass_slots(decodes) <= self.available_slots():
            return []
        retracted = self.retract_for_decode()
        self.check_room_after_retraction()
        for req in retracted:
            req.time_stats.retracted.append(now)
        self.stats.num_retractions += len(retracted)
        return retracted

    def nothing_can_run(self, head: Req) -> RuntimeError:
        """The error of a step that has nothing to run while ``head`` waits: its prefill cannot fit."""
        need, free = slots_to_extend(head, self.page_size), self.available_slots()
        why = (
            "nothing running will free more"
            if need > free
            else "so it fits, yet admission admitted no one. With nothing running, the first in line is admitted "
            "whenever its prefill fits the room, available_slots() (the prefix cache's evictable slots count: they are "
            "given back on demand): even when it is longer than the step's prefill budget (it is then the step's only "
            "prefill), whatever its later tokens will need. And admit_new_requests returns the requests it started "
            "(stage 7: the half-prefilled request's next chunk first)"
        )
        return RuntimeError(
            f"nothing can run: request {head.rid} is first in line and its prefill needs {need} KV slots, {free} of "
            f"{self.runner.allocator.size} are available ({self.runner.allocator.available_size()} free, the rest "
            f"held by the prefix cache and evictable); {why}"
        )

    def record_step(
        self,
        batch: ScheduleBatch,
        prefill_tokens: int,
        retracted: Sequence[Req],
        outputs: Sequence[TokenOutput],
        span: tuple[float, float],
    ) -> None:
        """A processed step's statistics, and its ``StepTrace`` for ``on_step`` (from the start of
        its scheduling to the end of its processing)."""
        stats = self.stats
        stats.steps += 1
        stats.peak_running = max(stats.peak_running, len(batch.reqs))
        stats.prefill_tokens += prefill_tokens
        stats.decode_tokens += len(batch.decode_reqs)
        if self.on_step is not None:
            self.on_step(
                StepTrace(
                    step=stats.steps,
                    start=span[0],
                    end=span[1],
                    prefill_rids=[req.rid for req in batch.prefill_reqs],
                    prefill_tokens=prefill_tokens,
                    decode_rids=[req.rid for req in batch.decode_reqs],
                    running=len(self.running),
                    waiting=len(self.waiting),
                    free_slots=self.runner.allocator.available_size(),
                    pool_size=self.runner.allocator.size,
                    retracted_rids=[req.rid for req in retracted],
                    finished_rids=[out.rid for out in outputs if out.finish_reason is not None],
                )
            )

    # --- checking ---------------------------------------------------------------------------------

    def reqs_holding_memory(self) -> list[Req]:
        """The requests that hold a table row and KV slots: the running ones (stage 7 adds its
        half-prefilled request)."""
        return list(self.running)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the memory bookkeeping is consistent; call it between steps.

        - every running request holds a table row, and K/V slots for exactly its cached positions;
          a waiting request holds nothing (a retracted one gave everything back);
        - every allocated KV page belongs to exactly one running request or to the prefix cache:
          nothing leaked, nothing shared, nothing freed twice;
        - every table row is either free or held by exactly one running request;
        - with nothing running, every slot is free or held by the prefix cache.
        """
        pool, allocator = self.runner.req_to_token_pool, self.runner.allocator
        problems, owners, names = [], [], []
        holders = self.reqs_holding_memory()
        for req in holders:
            if req.req_pool_idx is None:
                problems.append(f"running request {req.rid} has no table row (req_pool_idx is None)")
                continue
            own_from = req.prefix_match.cached_len if req.prefix_match is not None else 0
            owners.append(pool.req_to_token[req.req_pool_idx, own_from : req.cached_len])
            names.append(f"request {req.rid}")
        for req in self.waiting:
            if req.req_pool_idx is not None or req.cached_len:
                problems.append(
                    f"waiting request {req.rid} still holds memory (req_pool_idx={req.req_pool_idx}, "
                    f"cached_len={req.cached_len}); "
                    "a retracted request must give its slots and row back, and an admitted one must leave the queue "
                    "(admission pops the head it admits: waiting.popleft())"
                )
        rows = [req.req_pool_idx for req in holders if req.req_pool_idx is not None]
        if sorted(rows + pool.free_slots) != list(range(pool.size)):
            problems.append(
                f"table rows: running requests hold {sorted(rows)}, free rows are {sorted(pool.free_slots)}; "
                f"together they should be 0..{pool.size - 1}, each once"
            )
        cached = self.prefix_cache.cached_slots()
        owners.append(cached)
        names.append("the prefix cache")
        try:
            allocator.check_invariants(owners)
        except AssertionError as error:
            legend = ", ".join(f"owner {i} = {name}" for i, name in enumerate(names))
            problems.append(f"{error} ({legend})")
        if not holders:
            cached_pages = len(torch.unique(cached.reshape(-1) // self.page_size))
            held = allocator.size - allocator.available_size()
            if held != cached_pages * self.page_size:
                problems.append(
                    f"nothing is running, yet {held} of {allocator.size} KV slots are not free "
                    f"(the prefix cache holds {cached_pages * self.page_size}): a finished request did not free its "
                    "slots"
                )
        if problems:
            raise AssertionError("scheduler invariants broken:\n  " + "\n  ".join(problems))
