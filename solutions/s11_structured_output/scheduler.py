"""``GrammarScheduler``: stage 10's scheduler, with a grammar per constrained request.

What changes in the loop (SGLang's grammar path, the design notes' "constraint 3"):

    add       a constrained request does not join the waiting queue yet: it waits in
              ``grammar_queue`` while its grammar compiles on the backend's pool (cached by schema)
    poll      each step, the requests whose grammar is ready get their own matcher and join the
              waiting queue (last in line); a failed or too slow compilation aborts the request.
              A request still compiling never blocks the others: they are scheduled as usual
    sample    the worker masks the constrained rows' logits with their grammar's bitmask
    process   each sampled token moves its request's grammar on, before the stop checks; once
              the grammar is complete it allows only EOS, so the request ends with it
    retract   the grammar is rolled back to the tokens the request keeps (all of them here)
    leave     a request that finishes or is aborted drops its matcher

Overlap (stage 10) and grammars: the mask of step N+1 needs the token of step N, which the CPU
reads only after launching step N+1. SGLang resolves it as here: when the step in flight samples
for a constrained request, the next step waits for it and processes it first (a sync point, as a
retraction is), so every grammar has consumed its newest token before its next mask is filled.
Steps of free requests alone stay overlapped.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Hashable

from s02_request_and_sampling.req import Req
from s05_continuous_batching.scheduler import LeaveReason, TokenOutput
from s10_overlap_scheduling.overlap_worker import ForwardResult
from s10_overlap_scheduling.scheduler import LaunchedBatch, OverlapScheduler

from .grammar_backend import GrammarBackend
from .vocab_mask import GrammarWorker

GRAMMAR_TIMEOUT_S = 30.0  # a grammar still compiling after this long aborts its request
IDLE_WAIT_S = 0.05  # with nothing else to do, how long step() waits for a compilation


class GrammarScheduler(OverlapScheduler):
    def __init__(
        self, runner, prefix_cache, grammar_backend: GrammarBackend, grammar_timeout: float = GRAMMAR_TIMEOUT_S, **knobs
    ):
        """``grammar_backend`` compiles the grammars; ``grammar_timeout``: seconds a grammar may take
        to compile before its request is aborted. ``knobs``: stage 10's."""
        super().__init__(runner, prefix_cache, **knobs)
        self.grammar_backend = grammar_backend
        self.grammar_timeout = grammar_timeout
        # constrained requests whose grammar is compiling, with the Future of its compiled matcher
        self.grammar_queue: deque[tuple[Req, Future]] = deque()

    @property
    def has_work(self) -> bool:
        return super().has_work or bool(self.grammar_queue)

    def make_worker(self) -> GrammarWorker:
        return GrammarWorker(self.runner, self.future_map)

    def check_invariants(self) -> None:
        """Stage 10's, and the grammars': a request still compiling is nowhere else; each request's
        grammar is its own (a matcher shared by two requests is moved on by both) and has consumed
        exactly the tokens its request holds (a future id in flight is not one yet)."""
        for req, _ in self.grammar_queue:
            if req.grammar is not None or req.req_pool_idx is not None or req in self.waiting:
                raise AssertionError(
                    f"request {req.rid} is in grammar_queue but was admitted (it has a grammar, a place in line or "
                    "memory): a request leaves grammar_queue when its grammar is ready, or each poll admits it again"
                )
        reqs = [r for r in [*self.reqs_holding_memory(), *self.waiting] if r.grammar and not r.finished]
        owners: dict[int, Req] = {}
        for req in reqs:
            other = owners.setdefault(id(req.grammar.matcher), req)
            if other is not req:
                raise AssertionError(
                    f"requests {other.rid} and {req.rid} share one grammar matcher: each request needs its own "
                    "(grammar_backend.new_grammar copies the compiled one), or both move it on"
                )
            held = sum(token_id >= 0 for token_id in req.output_ids)
            if req.grammar.num_tokens != held:
                raise AssertionError(
                    f"request {req.rid}'s grammar has consumed {req.grammar.num_tokens} token(s), but the request "
                    f"holds {held}: a request starts with a grammar of its own at its start (new_grammar), which "
                    "consumes each of its tokens once"
                )
        super().check_invariants()

    # --- requests in and out ---------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Queue a request; a constrained one waits in grammar_queue while its grammar compiles."""
        super().add_request(req)  # every stage's checks; a constrained request leaves the line at once:
        key = getattr(req.sampling_params, "grammar_key", None)
        if key is not None:
            self.waiting.remove(req)
            self.grammar_queue.append((req, self.grammar_backend.get(key)))

    def poll_grammars(self) -> list[TokenOutput]:
        """Move every request whose grammar is compiled to the waiting queue, with its own matcher;
        abort those whose compilation failed or took longer than ``grammar_timeout``. Returns the
        outputs of the aborted ones."""
        outputs: list[TokenOutput] = []
        now = self.clock()
        # BEGIN EXERCISE: admit the requests whose grammar is ready; abort failures and timeouts
        # [#compiling-in-the-background]
        for req, future in list(self.grammar_queue):
            timed_out = not future.done() and now - req.time_stats.arrival > self.grammar_timeout
            if not future.done() and not timed_out:
                continue  # still compiling: the others go on without it
            self.grammar_queue.remove((req, future))
            if timed_out or future.exception() is not None:
                req.abort()
                req.time_stats.finished = now
                req.grammar_error = (
                    f"the grammar took longer than {self.grammar_timeout} s to compile"
                    if timed_out
                    else str(future.exception())
                )
                outputs.append(TokenOutput(req.rid, [], req.finished_reason))
                continue
            req.grammar = self.grammar_backend.new_grammar(future.result())
            self.waiting.append(req)
        return outputs
        # END EXERCISE

    def abort_request(self, rid: Hashable) -> bool:
        for req, future in self.grammar_queue:
            if req.rid == rid:  # still compiling: it holds no memory (the compilation stays cached)
                self.grammar_queue.remove((req, future))
                req.abort()
                req.time_stats.finished = self.clock()
                return True
        return super().abort_request(rid)

    def release_req(self, req: Req, why: LeaveReason) -> None:
        """Stage 5's release; a request that leaves for good drops its matcher, a retracted one
        keeps it, rolled back to the tokens it keeps (it recomputes them all when readmitted)."""
        super().release_req(req, why)
        if req.grammar is None:
            return
        # BEGIN EXERCISE: a retracted request keeps its grammar at its kept tokens; others drop it
        # [#retraction-and-abort]
        if why == "retracted":
            req.grammar.rollback_to(len(req.output_ids))
        else:
            req.grammar = None
        # END EXERCISE

    # --- the loop -----------------------------------------------------------------------------------------

    def step(self) -> list[TokenOutput]:
        outputs = self.poll_grammars() if self.grammar_queue else []
        if not super().has_work:
            if self.grammar_queue:  # only compilations are left: wait a little for one of them
                wait([future for _, future in self.grammar_queue], IDLE_WAIT_S, FIRST_COMPLETED)
            return outputs
        return outputs + super().step()

    def must_wait_for_last(self) -> bool:
        """Stage 10's sync points, and one more: the step in flight sampled for a constrained
        request, whose next mask needs that token."""
        return super().must_wait_for_last() or any(req.grammar is not None for req in self.last.sampled)

    def process_batch_result_overlap(
        self, launched: LaunchedBatch, result: ForwardResult, next_batch: LaunchedBatch | None
    ) -> list[TokenOutput]:
        """Each constrained request's grammar consumes its token first, then stage 10's processing
        (the stop checks: EOS, the only token a complete grammar allows, ends the request)."""
        gave_up: list[Req] = []
        if any(req.grammar is not None for req in launched.sampled):  # free steps are stage 10's alone
            self.accept_tokens(launched.sampled, result.token_ids)
            gave_up = [r for r in launched.sampled if r.grammar is not None and r.grammar.failure and not r.finished]
        for req in gave_up:  # the library's limits: this request ends with the reason, the batch goes on
            req.grammar_error = req.grammar.failure
            self.abort_in_flight(req)  # released below, its token dropped
        outputs = super().process_batch_result_overlap(launched, result, next_batch)
        return outputs + [TokenOutput(req.rid, [], req.finished_reason) for req in gave_up]

    def accept_tokens(self, sampled: list[Req], token_ids: list[int]) -> None:
        """Move each constrained request's grammar on by its sampled token (row i of ``token_ids``
        is ``sampled[i]``'s); a request that already ended drops its token, so its grammar too."""
        # BEGIN EXERCISE: move each constrained request's grammar on by its sampled token [#what-you-write]
        for req, token_id in zip(sampled, token_ids):
            if req.grammar is not None and not req.finished:
                req.grammar.accept_token(token_id)
        # END EXERCISE
