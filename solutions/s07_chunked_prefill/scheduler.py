"""``ChunkedPrefillScheduler``: a per-step prefill budget, long prompts computed a chunk per step.

Without chunking a step computes every admitted prompt whole, and the running requests' decode
tokens ride in the same pass: a 4000-token prompt makes that pass (and so every running
request's next token) as slow as a 4000-token prefill. With ``chunked_prefill_size`` = 512 the
same prompt takes 8 steps, each a 512-token chunk next to the decodes, so nobody's stream stops
(the README's "The idea" draws those steps).

Rules of the half-prefilled request (SGLang's ``chunked_req``; at most one at a time, since
cutting a prompt uses up the step's budget):

- it keeps its table row and the K/V of its finished chunks between steps, and it is out of the
  running list (it has no token to decode); its next chunk goes first in the next step's budget,
  ahead of every waiting request, so it keeps its place;
- it is never sampled before its last chunk: its logits of an unfinished prompt mean nothing,
  and sampling would also advance its random generator, so its tokens would depend on the budget;
- after each chunk its K/V go to the prefix cache (``cache_unfinished_req``): with the radix
  cache, the finished chunks are shared and survive a retraction;
- when the pool runs short it is retracted first (it has produced nothing for its user yet).

A prompt is shared as soon as it is computed, not only when its request leaves (SGLang does the
same): after its last chunk every prefilled request's prompt goes into the tree too. And requests
that arrive together with the same long prefix (a system prompt) must not all compute it in the
same step: a waiting request that would compute again what a request ahead of it computes in this
pass (at least ``IN_BATCH_SHARED_MIN`` tokens) is held back for this step (after SGLang's in-batch
prefix check, which moves it to the back of its longest-prefix order), and finds the prefix in the
tree in the next one.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from s02_request_and_sampling.req import Req
from s04_paged_kv_pool.allocator import pages_for
from s05_continuous_batching.schedule_batch import ScheduleBatch
from s06_radix_cache.radix_cache import RadixCache
from s06_radix_cache.scheduler import RadixScheduler

from .prefix_cache import ChunkedPrefixCache

# A waiting request that would compute at least IN_BATCH_SHARED_MIN tokens that a request ahead of
# it computes in the same pass waits a step instead (SGLang's threshold: a smaller overlap is not
# worth a step of its time to first token). Only the first IN_BATCH_CHECK_WINDOW waiting requests
# are compared: the check runs every step.
IN_BATCH_SHARED_MIN = 32
IN_BATCH_CHECK_WINDOW = 128


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """How many tokens ``a`` and ``b`` have in common from position ``start`` on."""
    n, i = min(len(a), len(b)), start
    while i < n and a[i] == b[i]:
        i += 1
    return i - start


def prefill_pending(req: Req) -> bool:
    """Whether the request's prefill is unfinished after its current pass (more chunks to go)."""
    return req.device_len < len(req.fill_ids)


class ChunkedPrefillScheduler(RadixScheduler):
    prefix_cache: ChunkedPrefixCache

    def __init__(self, runner, prefix_cache, chunked_prefill_size: int | None = 512, **knobs):
        """``chunked_prefill_size``: the prompt tokens one step may compute; a prompt that does not
        fit what is left of it is cut there and continued in later steps. None: no chunking
        (stage 6: a prompt is computed whole, as its step's only prefill if it is longer than
        the budget).
        ``prefix_cache`` must offer ``cache_unfinished_req`` (see prefix_cache.py); ``knobs``:
        stage 6's (schedule_policy, max_prefill_tokens, new_token_ratio, on_step, clock)."""
        if chunked_prefill_size is not None and chunked_prefill_size < 1:
            raise ValueError(
                "chunked_prefill_size must be a positive number of tokens or None (no chunking), got "
                f"{chunked_prefill_size}"
            )
        super().__init__(runner, prefix_cache, **knobs)
        self.chunked_prefill_size = chunked_prefill_size
        self.chunked_req: Req | None = None  # the request whose prefill is half done, between steps

    # --- the budget --------------------------------------------------------------------------------

    def step_budget(self) -> int:
        """Prompt tokens one step may compute."""
        if self.chunked_prefill_size is None:
            return self.max_prefill_tokens
        return min(self.max_prefill_tokens, self.chunked_prefill_size)

    def prefill_len(self, req: Req, cached_len: int, budget: int) -> int:
        """The rest of ``req``'s fill_ids, cut to what is left of the step's budget."""
        rest = len(req.fill_ids) - cached_len
        # BEGIN EXERCISE: a request's pass length under the step's prefill budget [#what-you-write]
        if self.chunked_prefill_size is None or budget < 1:
            return rest
        return min(rest, budget)
        # END EXERCISE

    def next_chunk_len(self, req: Req, budget: int) -> int:
        """Tokens of the half-prefilled ``req``'s next chunk: the rest of its prompt, cut to the
        budget and to the pool's room after what the running requests keep back (0: no room)."""
        rest = self.prefill_len(req, req.cached_len, budget)
        room = self.available_slots() - self.reserved_slots(self.running)
        # Whole pages: the chunk first fills the request's last page, then takes new ones.
        room_tokens = (
            pages_for(req.cached_len, self.page_size) + max(room, 0) // self.page_size
        ) * self.page_size - req.cached_len
        return max(0, min(rest, room_tokens))

    def admit_new_requests(self, scheduled: Sequence[Req] = (), budget: int | None = None) -> list[Req]:
        """The half-prefilled request's next chunk first, then stage 5's admission of waiting
        requests in what is left of the budget (where the last one admitted may be cut), minus
        those held back for sharing a prefix with a request ahead of them (``admit_waiting``).
        ``scheduled`` and ``budget``: as in stage 5 (the step's budget by default). Returns every
        request that prefills in this pass: the half-prefilled one first (when its chunk runs), then
        those newly admitted; step() makes them all running."""
        budget = self.step_budget() if budget is None else budget
        continuing: list[Req] = []
        # BEGIN EXERCISE: the half-prefilled request's next chunk first, then the waiting requests'
        # [#the-half-prefilled-request-chunked_req]
        req = self.chunked_req
        if req is not None:
            chunk = self.next_chunk_len(req, budget)
            if chunk == 0:
                return []
            self.chunked_req = None
            req.device_len = req.cached_len + chunk
            budget -= chunk
            continuing.append(req)
            if prefill_pending(req):
                return continuing
        return continuing + self.admit_waiting(scheduled=[*scheduled, *continuing], budget=budget)
        # END EXERCISE

    def admit_waiting(self, scheduled: Sequence[Req], budget: int) -> list[Req]:
        """Stage 6's admission of waiting requests after ``scheduled``, with the waiting requests
        that would compute again a prefix a request ahead of them computes in this pass held back
        for one step (``held_back``); they keep their places in the queue."""
        held = self.held_back(scheduled)
        if not held:
            return super().admit_new_requests(scheduled=scheduled, budget=budget)
        order = {id(req): i for i, req in enumerate(self.waiting)}
        held_ids = set(map(id, held))
        kept = [req for req in self.waiting if id(req) not in held_ids]
        self.waiting.clear()
        self.waiting.extend(kept)
        try:
            return super().admit_new_requests(scheduled=scheduled, budget=budget)
        finally:
            rest = sorted([*self.waiting, *held], key=lambda req: order.get(id(req), -1))
            self.waiting.clear()
            self.waiting.extend(rest)

    def held_back(self, scheduled: Sequence[Req]) -> list[Req]:
        """The waiting requests (among the first IN_BATCH_CHECK_WINDOW) that would compute again at
        least IN_BATCH_SHARED_MIN tokens that a request ahead of them (one of ``scheduled``, or a
        waiting one not held back) computes in this pass: the same cached prefix, then the same
        next tokens. Next step they find those in the tree. Only with a cache that shares (the
        radix tree)."""
        if not isinstance(self.prefix_cache, RadixCache) or len(self.waiting) + len(scheduled) < 2:
            return []  # nothing shares, or no one to share with (a lone request: no tree walk per step)
        # Requests ahead, grouped by where their uncached part starts: the same tree node at the
        # same length is the same cached prefix, so only the tokens after it need comparing.
        ahead: dict[tuple, list[Req]] = {}
        for req in scheduled:
            if req.prefix_match is not None:
                ahead.setdefault((req.prefix_match.node, req.prefix_match.cached_len), []).append(req)
        held = []
        for i, req in enumerate(self.waiting):
            if i == IN_BATCH_CHECK_WINDOW:
                break
            match = self.prefix_cache.match_prefix(req.fill_ids[: req.max_prefix_len])
            start = match.cached_len
            group = ahead.setdefault((match.node, start), [])
            shared = max((common_prefix_len(req.fill_ids, other.fill_ids, start) for other in group), default=0)
            # what it could take from the tree next step: no more than max_prefix_len (a request
            # scoring its prompt takes nothing it has not scored, so waiting would gain it nothing)
            shared = min(shared, req.max_prefix_len - start)
            if shared >= IN_BATCH_SHARED_MIN:
                held.append(req)
            else:
                group.append(req)
        return held

    # --- after the pass ----------------------------------------------------------------------------

    def cache_unfinished_req(self, req: Req) -> None:
        """``req`` just computed a chunk: hand its K/V so far to the prefix cache and point its
        table row at the prefix the cache now holds for it."""
        if prefill_pending(req) and req.cached_len != req.device_len:
            raise RuntimeError(
                f"request {req.rid}: its chunk computed positions up to {req.device_len}, but cached_len is "
                f"{req.cached_len}: mark what the pass computed as cached (cached_len = device_len) before its K/V "
                "go into the prefix cache"
            )
        table = self.runner.req_to_token_pool.req_to_token
        slots = table[req.req_pool_idx, : req.cached_len].clone()
        match = self.prefix_cache.cache_unfinished_req(req.fill_ids[: req.cached_len], slots, req.prefix_match)
        aligned = req.cached_len // self.page_size * self.page_size
        if isinstance(self.prefix_cache, RadixCache) and match.cached_len < aligned:
            # Said here: a stale match otherwise surfaces steps later as a double free of the
            # duplicates the tree just freed, far from its cause.
            raise RuntimeError(
                f"request {req.rid}: cache_unfinished_req returned a match of {match.cached_len} tokens, but the "
                f"tree now holds the request's first {aligned} (its whole pages): return the tree's match of what "
                "was inserted (match_prefix after the insert), locked, not the match it was given"
            )
        table[req.req_pool_idx, : match.cached_len] = match.slots
        req.prefix_match = match

    def process_batch_result(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        """A request whose prefill is still pending stores its chunk and waits for its next one
        (never sampled); everyone else goes through stage 5's processing, with its own logits row."""
        # BEGIN EXERCISE: park the requests whose prefill is pending; sample the others
        # [#the-half-prefilled-request-chunked_req]
        pending = [i for i, req in enumerate(batch.reqs) if prefill_pending(req)]
        for i in pending:
            req = batch.reqs[i]
            req.cached_len = req.device_len
            self.cache_unfinished_req(req)
            self.running.remove(req)
            self.chunked_req = req
        rest = [i for i in range(len(batch.reqs)) if i not in pending]
        others = ScheduleBatch(
            self.runner,
            self.prefix_cache,
            decode_reqs=batch.decode_reqs,
            prefill_reqs=[req for req in batch.prefill_reqs if not prefill_pending(req)],
        )
        # (indexing copies every row's logits: only when a row must go)
        sampled = super().process_batch_result(others, logits[rest] if pending else logits)
        self.share_prompts(others.prefill_reqs)
        return sampled
        # END EXERCISE

    def share_prompts(self, prefilled: Sequence[Req]) -> None:
        """The requests in ``prefilled`` computed their last chunk in this pass: those still
        running hand their prompt's K/V to the prefix cache now (``cache_unfinished_req``), so a
        request held back behind one of them (``held_back``) finds it in the next step instead of
        when it leaves. A finished one was handed over by its release already."""
        for req in prefilled:
            if not req.finished:
                self.cache_unfinished_req(req)

    # --- the half-prefilled request elsewhere ------------------------------------------------------

    def retract_for_decode(self) -> list[Req]:
        """The half-prefilled request is retracted first (to the front of the queue: it keeps its
        place); then, if the pool is still short, stage 5 retracts running requests."""
        retracted = []
        req = self.chunked_req
        if req is not None:
            self.chunked_req = None
            self.release_req(req, "retracted")  # with the radix cache its finished chunks stay in the tree
            self.waiting.appendleft(req)
            retracted.append(req)
        return retracted + super().retract_for_decode()

    def abort_request(self, rid: Hashable) -> bool:
        req = self.chunked_req
        if req is None or req.rid != rid:
            return super().abort_request(rid)
        self.chunked_req = None
        self.release_req(req, "aborted")
        req.abort()
        req.time_stats.finished = self.clock()
        return True

    @property
    def has_work(self) -> bool:
        return super().has_work or self.chunked_req is not None

    def reqs_holding_memory(self) -> list[Req]:
        return super().reqs_holding_memory() + ([self.chunked_req] if self.chunked_req is not None else [])
