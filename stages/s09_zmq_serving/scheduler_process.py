"""The scheduler process: it owns the engine and steps it, and does nothing else.

One loop, the heart of the server::

    while True:
        requests = recv_requests(block = engine has nothing to do)   new requests, aborts, debug questions
        for each: process_input_request                               engine.add_request / abort_request
        if engine.has_work:
            outputs = run_batch()                                      one forward pass (engine.step)
            send_to_detokenizer(outputs)                               the new token ids, as one message

It drains its socket without waiting while the engine has work (a request that arrives during
a step joins at the next step: continuous batching), and blocks on the socket when idle instead
of spinning. An abort is handled before the next step, so a client that went away costs at most
one more step, and its KV slots are freed at once. A request the engine could never serve (a
prompt longer than the context) raises ValueError in add_request: it goes back to its client as
an error, and the loop goes on.

No message and no step may end this process (the rules of ``worker_loop.py``):
``process_input_request`` answers whatever a message raises with an error to its request, and
``run_batch`` turns a step that raises into an error for each request of that step, after the
engine has freed everything they held (``abort_failed_step``). Then the pool's and the tree's
invariants are checked: only if they are broken, so that nothing this process computes can be
trusted any more, does it end, loudly (the launcher stops the server with the reason).

The scheduler also loads the tokenizer: the engine's ``Req`` reads the generated text to detect
stop strings (stage 2), and that decision must be made here, where the request is stepped.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Hashable

import torch
import zmq

from s02_request_and_sampling.req import FinishReason  # noqa: F401
from s08_cuda_graph.engine import CudaGraphEngine

from .io_struct import (
    AbortReq,
    BatchTokenIDOut,
    DebugFaultReq,
    DebugStateOut,
    DebugStateReq,
    EngineStateOut,
    EngineStateReq,
    ErrorOut,
    PromptEcho,
    TokenizedGenerateReqInput,
    describe_error,
)
from .server_args import served_stage
from .worker_loop import IDLE_POLL_MS, Fault, Heartbeats

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(model: str, knobs: dict[str, Any]) -> CudaGraphEngine:
    """The engine the server runs (``served_stage``): by default stage 11's (stage 10's engine with
    structured output, overlapped where it pays); with ``--disable-overlap``, stage 8's, without the
    overlapped loop; with ``--tp-size`` above 1, stage 12's (stage 11's split across ranks). Later
    stages are imported only when they are served, so this stage (and its tests, which pass
    ``--disable-overlap``) needs nothing beyond stage 9."""
    knobs = dict(knobs)
    if isinstance(knobs.get("dtype"), str):
        if knobs["dtype"] not in DTYPES:
            raise ValueError(f"--dtype {knobs['dtype']!r} is not one of {sorted(DTYPES)}")
        knobs["dtype"] = DTYPES[knobs["dtype"]]
    stage = served_stage(knobs)
    if stage == 12:  # imported only when asked for
        from s12_tensor_parallel.engine import TPEngine

        return TPEngine(model, **knobs)
    knobs.pop("tp_size", None)
    if stage == 8:  # (--enable-overlap passes disable_overlap=False on to stage 11's engine)
        del knobs["disable_overlap"]
        return CudaGraphEngine(model, **knobs)
    from s11_structured_output.engine import Engine  # here, not at the top: see the docstring

    return Engine(model, **knobs)


def context_len(engine: CudaGraphEngine) -> int:
    """The longest sequence (prompt + generated) one request may reach on this engine."""
    runner = engine.runner
    return min(
        engine.model.config.max_position_embeddings, runner.req_to_token_pool.max_context_len, runner.allocator.size
    )


class SchedulerProcess:
    def __init__(
        self,
        engine: CudaGraphEngine,
        recv_from_tokenizer: zmq.Socket,
        send_to_detokenizer: zmq.Socket,
        heartbeats: Heartbeats | None = None,
    ):
        self.engine = engine
        self.recv_from_tokenizer = recv_from_tokenizer
        self.send_to_detokenizer = send_to_detokenizer
        self.heartbeats = heartbeats
        self.reqs: dict[Hashable, Any] = {}  # rid -> the engine's Req, while it is waiting or running
        self.echoing: set[Hashable] = set()  # the tracked requests whose first output carries their prompt (echo)
        self.context_len = context_len(engine)

    # --- the loop -------------------------------------------------------------------------------

    def event_loop(self) -> None:
        while True:
            raise NotImplementedError(
                "Stage 9: one turn of the loop: receive, process, run a batch, send - see stages/s09_zmq_serving/README.md#the-scheduler-loop-scheduler_processpy"  # noqa: E501 (one message, the learner's to read whole)
            )

    def recv_requests(self, block: bool) -> list:
        """Every message waiting on the socket. With ``block``, first wait for one (up to
        IDLE_POLL_MS, so the loop still comes round now and then). Each call is one loop
        iteration: it beats the heartbeat that /health reads, unless the engine can never step
        again (``fatal_error``): then it raises, and the process ends."""
        why = self.engine.fatal_error()
        if why is not None:  # this process ends with why, and the launcher stops the server (as for any dead worker)
            raise RuntimeError(f"the engine cannot run any more steps, so the scheduler stops: {why}")
        if self.heartbeats is not None:
            self.heartbeats.beat("scheduler")
        messages: list[Any] = []
        if block and not self.recv_from_tokenizer.poll(IDLE_POLL_MS):
            return messages
        while True:
            try:
                messages.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return messages
            except Exception:  # a message that cannot even be unpickled: dropped, said
                logger.exception("the scheduler dropped a message it could not read")

    def process_input_request(self, message) -> None:
        """One message; whatever it raises is logged and answered to its request (500), and the
        loop goes on (a request the engine had already taken is aborted first)."""
        try:
            if isinstance(message, TokenizedGenerateReqInput):
                self.handle_generate_request(message)
                if message.echo and message.rid in self.reqs:  # taken: its first output carries its prompt
                    self.echoing.add(message.rid)
            elif isinstance(message, AbortReq):
                self.abort_request(message.rid)
                self.echoing.discard(message.rid)
            elif isinstance(message, EngineStateReq):
                self.send_to_detokenizer.send_pyobj(EngineStateOut(message.rid, self.engine_state()))
            elif isinstance(message, DebugStateReq):
                self.send_to_detokenizer.send_pyobj(DebugStateOut(message.rid, self.debug_state()))
            elif isinstance(message, DebugFaultReq):
                self.arm_fault(message)
                self.send_to_detokenizer.send_pyobj(message)  # on to the detokenizer, which answers
            else:
                raise TypeError(f"the scheduler got a message it does not know: {message!r:.100}")
        except Exception as error:
            rid = getattr(message, "rid", None)
            logger.exception(
                "the scheduler failed on %s %s; the request gets an error, the process goes on",
                type(message).__name__,
                rid or "",
            )
            if isinstance(message, TokenizedGenerateReqInput) and self.reqs.pop(rid, None) is not None:
                self.engine.abort_request(rid)  # the engine had taken it: free what it holds
                self.echoing.discard(rid)
            if isinstance(rid, str) and not isinstance(message, AbortReq):
                self.send_to_detokenizer.send_pyobj(
                    ErrorOut.internal(rid, error, "the scheduler failed on this request")
                )

    # --- requests in ------------------------------------------------------------------------------

    def handle_generate_request(self, req: TokenizedGenerateReqInput) -> None:
        params = req.sampling_params
        if req.fill_max_new_tokens:  # no max_tokens: up to the end of the context
            room = self.context_len - len(req.input_ids) + 1
            if 1 <= room < params.min_new_tokens:  # (room < 1: the prompt alone is too long, add_request says so)
                message = (
                    f"a prompt of {len(req.input_ids)} tokens leaves room for {room} new tokens in the context of "
                    f"{self.context_len}, fewer than min_tokens={params.min_new_tokens}"
                )
                self.send_to_detokenizer.send_pyobj(
                    ErrorOut(req.rid, message, 400, param="min_tokens", code="context_length_exceeded")
                )
                return
            params = dataclasses.replace(params, max_new_tokens=max(1, room))
        raise NotImplementedError(
            "Stage 9: add a tokenized request to the engine, or answer why it cannot be served - see stages/s09_zmq_serving/README.md#the-scheduler-loop-scheduler_processpy"  # noqa: E501 (one message, the learner's to read whole)
        )

    def abort_request(self, rid: str) -> None:
        """The client went away: end the request now (its KV is freed) and tell the detokenizer
        to forget it. A request that already finished is gone: nothing to do."""
        raise NotImplementedError(
            "Stage 9: abort a request and tell the detokenizer - see stages/s09_zmq_serving/README.md#aborts-on-disconnect"  # noqa: E501 (one message, the learner's to read whole)
        )

    # --- one step -------------------------------------------------------------------------------

    def run_batch(self) -> list:
        """One engine step; its TokenOutputs. If the step raises (a forward pass that failed, a
        sampler that refused a value), its requests are aborted by the engine, which frees what
        they held, and each gets an error (500); the loop goes on (a step that failed before it
        admitted anyone fails the waiting requests instead). Raises only if the invariants
        are broken afterwards: then the state cannot be trusted, and the process must end."""
        try:
            return self.engine.step()
        except Exception as error:
            logger.exception("a step failed; its requests are aborted with an error and their KV freed")
            failed = self.engine.abort_failed_step()
            if not failed:
                # Nobody held memory: the step failed while choosing its batch, before any request
                # was admitted. Every waiting request would meet the same error at once on the next
                # loop, forever, so they end now with it rather than wait for a timeout.
                failed = [req for rid, req in list(self.reqs.items()) if self.engine.abort_request(rid)]
            for req in failed:
                self.echoing.discard(req.rid)
                if self.reqs.pop(req.rid, None) is not None:
                    self.send_to_detokenizer.send_pyobj(
                        ErrorOut.internal(str(req.rid), error, "the engine failed while running this request")
                    )
            problems = self.check_invariants()
            if problems is not None:
                raise RuntimeError(
                    f"after a failed step ({describe_error(error)}) the engine's state is broken, "
                    f"so the scheduler stops:\n{problems}"
                ) from error
            logger.warning(
                "aborted %d request(s) of the failed step; the invariants hold, serving goes on", len(failed)
            )
            return []

    # --- outputs out ------------------------------------------------------------------------------

    def send_outputs(self, outputs) -> None:
        """One step's TokenOutputs as one BatchTokenIDOut; finished requests are forgotten."""
        if not outputs:
            return
        batch = BatchTokenIDOut([], [], [], [], [], [], [])
        for out in outputs:
            req = self.reqs.get(out.rid)
            if req is None:
                # Only an abort_request that dropped the request here without ending it in the
                # engine gets here: it still runs and holds its KV. Said, not crashed on, so that
                # /debug/state (untracked_requests) and the leak checks can show it.
                logger.error(
                    "the engine stepped request %s, which this process does not track: either abort_request "
                    "dropped it from self.reqs without engine.abort_request (it still runs and holds its KV), or "
                    "it was added without rid=req.rid (the engine numbered it itself)",
                    out.rid,
                )
                continue
            if out.rid in self.echoing:  # its first output: the prompt goes first (complete by now)
                self.echoing.discard(out.rid)
                scored = req.sampling_params.prompt_logprobs is not None
                batch.echoes[out.rid] = PromptEcho(list(req.origin_input_ids), req.prompt_logprobs if scored else None)
            if out.finish_reason is not None:
                del self.reqs[out.rid]
                if out.finish_reason.type == "abort" and req.grammar_error is not None:
                    # stage 11: its grammar did not compile, or the grammar library gave up on it;
                    # the error names the field the grammar came in (a JSON schema: response_format)
                    param = "regex" if getattr(req.sampling_params, "regex", None) is not None else "response_format"
                    self.send_to_detokenizer.send_pyobj(ErrorOut(out.rid, req.grammar_error, 400, param))
                    continue
            batch.rids.append(out.rid)
            batch.new_token_ids.append(list(out.new_token_ids))
            batch.finish_reasons.append(out.finish_reason)
            batch.prompt_tokens.append(len(req.origin_input_ids))
            batch.completion_tokens.append(len(req.output_ids))
            batch.stops.append(req.sampling_params.stop)
            batch.new_logprobs.append(list(out.new_logprobs))
        if batch.rids:
            self.send_to_detokenizer.send_pyobj(batch)

    # --- checks and debugging ------------------------------------------------------------------------

    def check_invariants(self) -> str | None:
        """The scheduler's and the radix tree's invariant checks: None if they hold, else what is broken."""
        tree = getattr(self.engine, "tree_cache", None)
        try:
            self.engine.scheduler.check_invariants()
            if tree is not None:
                tree.check()
        except AssertionError as error:
            return str(error)
        if not self.echoing <= self.reqs.keys():
            stray = sorted(map(str, self.echoing - self.reqs.keys()))
            return f"requests to echo that this process no longer tracks: {stray}"
        return None

    def engine_state(self) -> dict[str, Any]:
        """The numbers /metrics shows (metrics.py), between two steps: cheap, no invariant walks."""
        scheduler, allocator = self.engine.scheduler, self.engine.runner.allocator
        tree = getattr(self.engine, "tree_cache", None)
        evictable = tree.evictable_size() if tree is not None else 0  # slots only the cache holds
        stats = scheduler.stats
        return {
            # running: every request that holds memory (the half-prefilled one, one that waits for a step in flight)
            "running": len(scheduler.reqs_holding_memory()),
            "waiting": len(scheduler.waiting),
            "pool_size": allocator.size,
            "held_slots": allocator.size - allocator.available_size() - evictable,
            "prefill_tokens": stats.prefill_tokens,
            "cached_tokens": stats.cached_tokens,
            "decode_tokens": stats.decode_tokens,
            "steps": stats.steps,
            "retractions": stats.num_retractions,
        }

    def debug_state(self) -> dict[str, Any]:
        """The engine's counts (``engine_state``), the invariant checks and what every request
        holds, between two steps (for /debug/state)."""
        scheduler, allocator = self.engine.scheduler, self.engine.runner.allocator
        tree = getattr(self.engine, "tree_cache", None)
        in_engine = [req.rid for req in [*scheduler.waiting, *scheduler.reqs_holding_memory()] if not req.finished]
        return {
            **self.engine_state(),
            "tracked_requests": len(self.reqs),
            # requests the engine still runs that this process forgot (an abort that did not end them there)
            "untracked_requests": [rid for rid in in_engine if rid not in self.reqs],
            "free_slots": allocator.available_size(),
            "tree_cached_tokens": tree.total_size() if tree is not None else 0,
            "tree_locked_tokens": tree.protected_size_ if tree is not None else 0,
            "context_len": self.context_len,
            # where and how the passes run: e.g. "cuda:0", "torch.bfloat16", {"eager": 12, "graph": 340}
            "device": str(self.engine.model.device),
            "dtype": str(self.engine.model.dtype),
            "forward_paths": dict(self.engine.runner.forward_paths),
            "invariants": self.check_invariants() or "ok",
        }

    def arm_fault(self, fault: DebugFaultReq) -> None:
        """An injected fault for the scheduler strikes inside the next step's forward pass, after
        its KV slots were allocated: the hardest place to recover from."""
        if fault.process != "scheduler":
            return
        runner = self.engine.runner
        forward = runner.forward
        armed = Fault()
        armed.arm(fault, "scheduler")

        def faulty_forward(batch):
            del runner.forward  # one shot: the class's own forward is back
            armed.fire()
            return forward(batch)

        runner.forward = faulty_forward  # type: ignore[method-assign]  # one shot, see faulty_forward


def run_scheduler_process(server_args, ipc, ready, heartbeats) -> None:
    """The scheduler process: build the engine, PULL from the tokenizer, PUSH to the detokenizer."""
    engine = build_engine(server_args.model, server_args.engine_knobs)
    context = zmq.Context()
    recv_from_tokenizer = context.socket(zmq.PULL)
    recv_from_tokenizer.bind(ipc.scheduler)
    send_to_detokenizer = context.socket(zmq.PUSH)
    send_to_detokenizer.connect(ipc.detokenizer)
    scheduler = SchedulerProcess(engine, recv_from_tokenizer, send_to_detokenizer, heartbeats)
    ready(
        {
            "context_len": scheduler.context_len,
            "device": str(engine.model.device),
            "vocab_size": engine.model.config.vocab_size,
            "max_running_requests": engine.scheduler.max_running_requests,
            "engine": engine.describe(),  # printed at start: threads, graphs, overlap, pool
        }
    )
    scheduler.event_loop()
