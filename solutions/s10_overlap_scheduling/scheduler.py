"""``OverlapScheduler``: stage 7's scheduler with SGLang's overlapped event loop.

Without overlap (stages 5-8, SGLang's ``event_loop_normal``) the CPU and the device take turns::

    CPU     [schedule 1]             [process 1][schedule 2]             [process 2][schedule 3] ...
    device              [forward 1]                         [forward 2]

With overlap (``event_loop_overlap``) the CPU builds the next step while the device runs this one,
and reads this step's tokens only after the next one is launched::

    CPU     [schedule 1][schedule 2][process 1][schedule 3][process 2][schedule 4][process 3] ...
    device              [forward 1][forward 2           ][forward 3           ][forward 4]

One ``step()`` (the loop's body):

    1. schedule  step N+1: retract / admit / build, as stage 5-7 do; a request of step N decodes
                 the token step N has not produced yet: its input is a future id (future_map.py)
    2. launch    hand step N+1 to the worker (overlap_worker.py); the CPU goes on at once
    3. process   step N's results (the CPU waits here only if step N is still running): replace
                 each request's future id by its token, check stop conditions, stream, free
    4. settle    step N+1's requests: their K/V are on their way (cached_len = device_len), and
                 each sampled one gets the future id of its next token as its last output id

What makes it hard, and how each case is handled here:

- finished but already scheduled: a request that step N finished (EOS, a stop string) was put in
  step N+1 before anyone knew. Its stream ends with step N; step N+1's token for it is dropped,
  and the slot that step stored is freed when step N+1 is processed: only then is its table row
  released, because step N+1's forward still reads it. A request whose pending token is its
  last (max_new_tokens) is known to end and is never scheduled again.
- abort: a request in the step in flight ends at once for its user, and is released the same way.
- retraction and a chunked prefill change table rows that the step in flight reads, so a step
  that must retract, or that follows a step with a half-prefilled request, first waits for the
  step in flight and processes it (a sync point, rare in decode-heavy serving).
- the radix cache: a leaving request's K/V are inserted once, with its real tokens and exactly
  the positions stage 8 inserts (never the dropped extra one).
- shared prompts (stage 7): a prompt reaches the tree only when its step is processed, after the
  next step was built, so the in-batch check counts the prompts of the step in flight as ahead
  too; and a prompt whose insert would swap some of its slots for the tree's copies (rows the
  step in flight reads) is handed over when its request leaves instead.

``enable_overlap = False`` runs the same pieces in the plain order (schedule, run, process), the
forward on the scheduler's own thread as in stage 8: what the timeline compares against.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from s02_request_and_sampling.engine import check_not_stuck
from s02_request_and_sampling.logprobs import TokenLogprob
from s02_request_and_sampling.prompt_logprobs import attach_prompt_entries
from s02_request_and_sampling.req import Req
from s04_paged_kv_pool.allocator import pages_for
from s05_continuous_batching.schedule_batch import ScheduleBatch
from s05_continuous_batching.scheduler import TokenOutput
from s07_chunked_prefill.scheduler import ChunkedPrefillScheduler, prefill_pending

from .future_map import FutureMap
from .overlap_worker import ForwardResult, OverlapWorker, Step

FUTURES_PER_ROW = 4  # future ids alive at once per table row (two steps hold at most one each per request)
TIMELINE_STEPS = 4096  # steps whose timings are kept (a server runs forever)


@dataclass
class StepTiming:
    """Where one step's time went (perf_counter seconds): the CPU work to build and launch it,
    its forward and sampling on the worker, and the CPU work to process its results."""

    step: int
    schedule: tuple[float, float]
    forward: tuple[float, float]
    process: tuple[float, float]


@dataclass
class LaunchedBatch:
    """A step handed to the worker whose results the CPU has not processed yet."""

    batch: ScheduleBatch
    sampled: list[Req]  # the requests this step samples a token for, in the worker's order
    chunked: list[Req]  # requests whose prefill goes on after this step (sampled nothing)
    future_ids: list[int]  # the future id of each sampled request's token
    result: Future  # of the worker's ForwardResult
    schedule: tuple[float, float]  # when the CPU built and launched it
    prefill_tokens: int  # prompt tokens it computes (counted at launch: settle moves the lengths on)
    retracted: list[Req] = field(default_factory=list)
    processed: bool = False  # its results were processed (process_last)


class OverlapScheduler(ChunkedPrefillScheduler):
    def __init__(self, runner, prefix_cache, enable_overlap: bool = True, **knobs):
        """``enable_overlap``: False runs the same pieces in the plain order (see the module
        docstring). ``knobs``: stage 7's (chunked_prefill_size, schedule_policy,
        max_prefill_tokens, new_token_ratio, on_step, clock)."""
        super().__init__(runner, prefix_cache, **knobs)
        self.enable_overlap = enable_overlap
        self.future_map = FutureMap(FUTURES_PER_ROW * self.max_running_requests, runner.device)
        self.worker: OverlapWorker | None = None  # started with the first step
        self.last: LaunchedBatch | None = None  # the step in flight
        self.ending: list[Req] = []  # ended while in the step in flight: released when it is processed
        self.timeline: deque[StepTiming] = deque(maxlen=TIMELINE_STEPS)
        self.dropped_tokens = 0  # tokens sampled for requests that had already ended: what overlap wastes

    @property
    def has_work(self) -> bool:
        return super().has_work or self.last is not None

    def reqs_holding_memory(self) -> list[Req]:
        return super().reqs_holding_memory() + self.ending

    def check_invariants(self) -> None:
        """Stage 5's, and overlap's own: every request of the step in flight keeps its table row
        until that step is processed, because its forward reads the row (released early, the row
        could be handed to a request admitted meanwhile, and rewritten while the forward runs)."""
        gone = [req.rid for req in self.ending if req.req_pool_idx is None]
        if gone:
            raise AssertionError(
                f"request(s) {gone} are still in self.ending but were released (they hold no table row): "
                "release_ended takes a request it releases out of self.ending"
            )
        released = [req.rid for req in self.last.batch.reqs if req.req_pool_idx is None] if self.last else []
        if released:
            raise AssertionError(
                f"request(s) {released} are in the step in flight but hold no table row: a request that ends while "
                "a launched step still holds it is released when that step is processed (self.ending), not before"
            )
        super().check_invariants()

    # --- the loop -----------------------------------------------------------------------------------

    def step(self) -> list[TokenOutput]:
        """One turn of the loop; returns what the requests of the step it processed got."""
        if not self.has_work:
            return []
        if self.worker is None:
            self.worker = self.make_worker()
        if not self.enable_overlap:
            launched = self.schedule_and_launch()
            self.settle(launched)
            self.last = launched
            return self.process_last()
        in_flight = self.last
        outputs = self.overlapped_turn()
        if in_flight is not None and not in_flight.processed:
            # Its requests would wait forever for tokens that no later turn reads (or, kept in
            # flight, every later turn would find the same): the loop would never end.
            raise RuntimeError(
                "a turn of the overlapped loop ended without processing the step that was in flight when it began: "
                "every turn processes step N, after launching step N+1 (or before, when must_wait_for_last()), "
                "also a turn whose schedule_and_launch() returned None"
            )
        return outputs

    def overlapped_turn(self) -> list[TokenOutput]:
        """The loop's body with overlap: launch step N+1, then process step N (the module
        docstring's four parts); returns the outputs of the step(s) it processed."""
        # BEGIN EXERCISE: the overlapped order: launch step N+1, then process step N [#what-you-write]
        outputs: list[TokenOutput] = []
        if self.last is not None and self.must_wait_for_last():
            outputs += self.process_last()
        launched = self.schedule_and_launch()
        if self.last is not None:
            outputs += self.process_last(next_batch=launched)
        if launched is not None:
            self.settle(launched)
        self.last = launched
        return outputs
        # END EXERCISE

    def make_worker(self) -> OverlapWorker:
        """The worker that runs each step's forward and sampling (stage 11 masks the logits there)."""
        return OverlapWorker(self.runner, self.future_map)

    def must_wait_for_last(self) -> bool:
        """Whether the next step can only be built once the step in flight is processed: it
        left a half-prefilled request (its next chunk starts from what that step stores), or the
        pool is short and someone must be retracted (the step in flight reads their table rows)."""
        if self.last.chunked:
            return True
        return self.next_pass_slots(self.decoding_reqs()) > self.available_slots()

    def decoding_reqs(self) -> list[Req]:
        """The running requests that decode in the next step: all but those whose token in flight
        is their last one (max_new_tokens), which are known to end whatever that token is."""
        return [req for req in self.running if len(req.output_ids) < req.sampling_params.max_new_tokens]

    def schedule_and_launch(self) -> LaunchedBatch | None:
        """Build the next step (stage 5-7's retract and admit) and hand it to the worker.
        None if nothing can run now (everything waits for the step in flight)."""
        start = self.clock()
        if self.last is not None and self.must_wait_for_last():
            # Building now would read what the step in flight has not stored yet (a half-prefilled
            # request's next chunk starts from it) or retract requests whose rows it still reads.
            raise RuntimeError(
                "the next step is built while the step in flight must be processed first (a half-prefilled "
                "request's next chunk, or a retraction, starts from what it stores): step() must process it "
                "first whenever must_wait_for_last() says so"
            )
        retracted = self.retract_if_short(self.decoding_reqs(), start)  # only with nothing in flight: see above
        admitted = self.admit_new_requests()
        decodes = self.decoding_reqs()
        if not decodes and not admitted:
            if self.last is None and (self.waiting or self.chunked_req) and not self.ending:
                raise self.nothing_can_run(self.waiting[0] if self.waiting else self.chunked_req)
            return None
        batch = ScheduleBatch(self.runner, self.prefix_cache, decode_reqs=decodes, prefill_reqs=admitted)
        self.running += admitted  # from here on they hold memory
        forward_batch = batch.prepare_forward()  # slots allocated, table rows written; a future id stays as it is
        rows = [i for i, req in enumerate(batch.reqs) if not prefill_pending(req)]
        sampled = [batch.reqs[i] for i in rows]
        future_ids = self.future_map.alloc(len(sampled))
        chunked = [req for req in batch.reqs if prefill_pending(req)]
        built = self.clock()  # the CPU's part ends here (without overlap the forward runs next, on this thread)
        launch = self.worker.submit if self.enable_overlap else self.worker.run_now
        result = launch(Step(forward_batch, rows, sampled, future_ids, batch.prompt_rows))
        return LaunchedBatch(
            batch, sampled, chunked, future_ids, result, (start, built), batch.prefill_tokens, retracted
        )

    def settle(self, launched: LaunchedBatch) -> None:
        """The launched step's bookkeeping, done after the previous step was processed: the K/V of
        its tokens are on their way (the worker writes them before any later step reads them), and
        each sampled request that goes on gets its token's future id as its newest output id, so
        the next step feeds it (fill_ids[cached_len:device_len] is that one future id)."""
        for req in launched.batch.reqs:
            req.cached_len = req.device_len
        for req, future_id in zip(launched.sampled, launched.future_ids):
            if not req.finished:  # finished by the step processed just before: its token here is dropped
                req.append_token(future_id)

    # --- results --------------------------------------------------------------------------------------

    def process_last(self, next_batch: LaunchedBatch | None = None) -> list[TokenOutput]:
        """Wait for the step in flight (if it is still running) and process its results.
        ``next_batch``: the step launched meanwhile, which may still read its requests' rows."""
        launched, self.last = self.last, None
        launched.processed = True
        result = launched.result.result()  # the one place the CPU waits for the device
        start = self.clock()
        outputs = self.process_batch_result_overlap(launched, result, next_batch)
        end = self.clock()
        self.timeline.append(
            StepTiming(
                self.stats.steps + 1,
                launched.schedule,
                (result.start, result.end),
                (start, end),
            )
        )
        span = (launched.schedule[0], end)
        self.record_step(launched.batch, launched.prefill_tokens, launched.retracted, outputs, span)
        return outputs

    def process_batch_result_overlap(
        self, launched: LaunchedBatch, result: ForwardResult, next_batch: LaunchedBatch | None
    ) -> list[TokenOutput]:
        """Step N's results, while step N+1 runs: the half-prefilled requests keep their chunk and
        wait for the next one (as in stage 7); each sampled request replaces its future id by its
        token and checks its stop conditions; whoever finished is released, unless the step in
        flight (``next_batch``) still holds it. Requests that had already ended drop their token."""
        for req in launched.chunked:
            if req.finished:  # aborted while its chunk ran
                self.release_ended(req)
                continue
            self.cache_unfinished_req(req)
            self.running.remove(req)
            self.chunked_req = req
        attach_prompt_entries(launched.batch.prompt_rows, result.prompt_logprobs)
        outputs, got_token = self.process_sampled(launched, result.token_ids, next_batch)
        self.attach_logprobs(launched.sampled, result.logprobs, outputs)
        self.share_prompts([req for req in launched.batch.prefill_reqs if req not in launched.chunked])
        now = self.clock()
        for req in got_token:
            req.time_stats.got_token(now, req.finished)
        return outputs

    def held_back(self, scheduled: Sequence[Req]) -> list[Req]:
        """Stage 7's in-batch prefix check, with the prompts of the step in flight counted as
        ahead too: they reach the tree only when that step is processed, after this one is built."""
        in_flight = self.last.batch.prefill_reqs if self.last is not None else []
        return super().held_back([*scheduled, *in_flight])

    def share_prompts(self, prefilled: Sequence[Req]) -> None:
        """Stage 7's, while the next step may already be running and reading these requests'
        table rows: only a prompt of which the tree holds nothing beyond the request's own match
        is handed over now (the insert then leaves its row as it is); one that would swap some of
        its slots for the tree's copies is handed over when the request leaves."""
        for req in prefilled:
            if req.finished:
                continue
            held = self.prefix_cache.match_prefix(req.fill_ids[: req.cached_len]).cached_len
            if held <= req.prefix_match.cached_len:
                super().share_prompts([req])

    def process_sampled(
        self, launched: LaunchedBatch, token_ids: list[int], next_batch: LaunchedBatch | None
    ) -> tuple[list[TokenOutput], list[Req]]:
        """Each sampled request of step N with its future id and its token: the stream's outputs,
        and the requests that got a token."""
        # BEGIN EXERCISE: each future id becomes its token; release what ended, unless still in flight [#what-you-write]
        outputs: list[TokenOutput] = []
        got_token: list[Req] = []
        in_flight = set(map(id, next_batch.batch.reqs)) if next_batch is not None else set()
        for req, future_id, token_id in zip(launched.sampled, launched.future_ids, token_ids):
            if req.finished:
                self.drop_future(req, future_id)
                self.release_ended(req)
                self.dropped_tokens += 1
                continue
            assert req.output_ids[-1] == future_id, (
                f"request {req.rid}: its newest output id should be the future {future_id}"
            )
            req.output_ids[-1] = token_id
            req.check_finished()
            got_token.append(req)
            outputs.append(TokenOutput(req.rid, [token_id], req.finished_reason))
            if req.finished:
                self.running.remove(req)
                if id(req) in in_flight:
                    self.ending.append(req)
                else:
                    self.release_req(req, "finished")
        check_not_stuck(got_token)
        return outputs, got_token
        # END EXERCISE

    def attach_logprobs(
        self, sampled: list[Req], logprobs: list[TokenLogprob | None], outputs: list[TokenOutput]
    ) -> None:
        """The log-probabilities the worker computed (entry i: ``sampled[i]``'s, None if it did not
        ask) go with their tokens: to each request that kept its token, and to its TokenOutput.
        A request that had already ended dropped its token, and drops this too."""
        kept = {out.rid: out for out in outputs}
        for req, logprob in zip(sampled, logprobs):
            out = kept.get(req.rid)
            if logprob is not None and out is not None:
                req.output_logprobs.append(logprob)
                out.new_logprobs.append(logprob)

    def drop_future(self, req: Req, future_id: int) -> None:
        """An ended request's token of the step in flight is discarded: if its future id is its
        newest output id (it was still going when that step was settled), take it back out."""
        if req.output_ids and req.output_ids[-1] == future_id:
            req.output_ids.pop()
            req.device_len -= 1

    def release_ended(self, req: Req) -> None:
        """Release a request that ended before the results of a step that included it came: a
        finished one drops the position that step stored for it (freeing its page if that
        position had one of its own), so it leaves with the K/V of exactly the positions stage 8
        keeps: all but its last token. An aborted one keeps everything it computed (all real
        tokens: its future id is gone), as an abort between two stage-8 steps does."""
        # BEGIN EXERCISE: drop the extra position a dropped step stored, then release the request [#what-you-write]
        aborted = req.finished_reason.type == "abort"
        keep = req.cached_len if aborted else req.cached_len - 1
        first_free = pages_for(keep, self.page_size) * self.page_size
        if first_free < req.cached_len:
            self.runner.allocator.free(
                self.runner.req_to_token_pool.req_to_token[req.req_pool_idx, first_free : req.cached_len]
            )
        req.cached_len = keep
        self.release_req(req, "aborted" if aborted else "finished")
        if req in self.ending:
            self.ending.remove(req)
        # END EXERCISE

    # --- requests ending from outside -------------------------------------------------------------------

    def abort_request(self, rid: Hashable) -> bool:
        """A request in the step in flight ends now for its user; what it holds is released when
        that step is processed (its forward still reads its table row). Others: as in stage 7."""
        in_flight = next((req for req in self.last.batch.reqs if req.rid == rid), None) if self.last else None
        if in_flight is None or in_flight.finished:
            return super().abort_request(rid)
        self.abort_in_flight(in_flight)
        return True

    def abort_in_flight(self, req: Req) -> None:
        """End a request that a step still holds: out of running now; what it holds is released
        when that step is processed (``ending``: its token is dropped then)."""
        if req in self.running:
            self.running.remove(req)
        req.abort()
        req.time_stats.finished = self.clock()
        self.ending.append(req)

    def abort_failed_step(self) -> list[Req]:
        """A step raised (in its forward, its sampling or its processing): let the worker finish
        whatever it still had, forget the step in flight, take the future ids back out of every
        request that holds memory (their tokens will never come) and trust none of the K/V it
        computed itself, end the requests that were ending, then stage 5's clean-up of everyone
        holding memory (which frees every page nobody holds)."""
        self.last = None
        if self.worker is not None:
            self.worker.wait_idle()  # no forward may still read a table row that is freed below
        for req in self.reqs_holding_memory():
            while req.output_ids and req.output_ids[-1] < 0:
                req.output_ids.pop()
                req.device_len -= 1
            # settle moved cached_len on before the forward ran: the failed step's positions hold
            # no K/V, so nothing the request computed itself goes to the tree; stage 5's sweep frees it
            req.cached_len = req.prefix_match.cached_len if req.prefix_match is not None else 0
        ending, self.ending = self.ending, []
        for req in ending:
            self.release_req(req, "aborted")
        return ending + super().abort_failed_step()
