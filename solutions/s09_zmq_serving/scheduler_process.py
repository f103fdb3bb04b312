"""The scheduler process: it owns the engine and steps it, and does nothing else.

One loop, the heart of the server::

    while True:
        requests = recv_requests(block = engine has nothing to do)   new requests, aborts, debug questions
        for each: process_input_request                               engine.add_request / abort_request
        if engine.has_work:
            outputs = engine.step()                                    one forward pass
            send_to_detokenizer(outputs)                               the new token ids, as one message

It drains its socket without waiting while the engine has work (a request that arrives during
a step joins at the next step: continuous batching), and blocks on the socket when idle instead
of spinning. An abort is handled before the next step, so a client that went away costs at most
one more step, and its KV slots are freed at once. A request the engine could never serve (a
prompt longer than the context) raises ValueError in add_request: it goes back to its client as
an error, and the loop goes on.

The scheduler also loads the tokenizer: the engine's ``Req`` reads the generated text to detect
stop strings (stage 2), and that decision must be made here, where the request is stepped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import zmq

from s02_request_and_sampling.req import FinishReason
from s08_cuda_graph.engine import Engine  # the newest stage's engine: this one line picks what is served

from .io_struct import AbortReq, BatchTokenIDOut, DebugStateOut, DebugStateReq, ErrorOut, TokenizedGenerateReqInput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IDLE_POLL_MS = 1000  # when idle, wait this long for a message before looking again


def build_engine(model: str, knobs: dict[str, Any]) -> Engine:
    knobs = dict(knobs)
    if isinstance(knobs.get("dtype"), str):
        if knobs["dtype"] not in DTYPES:
            raise ValueError(f"--dtype {knobs['dtype']!r} is not one of {sorted(DTYPES)}")
        knobs["dtype"] = DTYPES[knobs["dtype"]]
    return Engine(model, **knobs)


def context_len(engine: Engine) -> int:
    """The longest sequence (prompt + generated) one request may reach on this engine."""
    runner = engine.runner
    return min(engine.model.config.max_position_embeddings, runner.req_to_token_pool.max_context_len, runner.allocator.size)


class SchedulerProcess:
    def __init__(self, engine: Engine, recv_from_tokenizer: zmq.Socket, send_to_detokenizer: zmq.Socket):
        self.engine = engine
        self.recv_from_tokenizer = recv_from_tokenizer
        self.send_to_detokenizer = send_to_detokenizer
        self.reqs: dict[str, Any] = {}  # rid -> the engine's Req, while it is waiting or running
        self.context_len = context_len(engine)

    # --- the loop -------------------------------------------------------------------------------

    def event_loop(self) -> None:
        while True:
            # BEGIN EXERCISE: receive what arrived (self.recv_requests: block only when the engine has no work), process each (self.process_input_request), then if the engine has work run one step and send its outputs (self.send_outputs)
            for message in self.recv_requests(block=not self.engine.has_work):
                self.process_input_request(message)
            if self.engine.has_work:
                self.send_outputs(self.engine.step())
            # END EXERCISE

    def recv_requests(self, block: bool) -> list:
        """Every message waiting on the socket. With ``block``, first wait for one (up to
        IDLE_POLL_MS, so the loop still comes round now and then)."""
        messages = []
        if block and not self.recv_from_tokenizer.poll(IDLE_POLL_MS):
            return messages
        while True:
            try:
                messages.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return messages

    def process_input_request(self, message) -> None:
        if isinstance(message, TokenizedGenerateReqInput):
            self.handle_generate_request(message)
        elif isinstance(message, AbortReq):
            self.abort_request(message.rid)
        elif isinstance(message, DebugStateReq):
            self.send_to_detokenizer.send_pyobj(DebugStateOut(message.rid, self.debug_state()))
        else:
            raise TypeError(f"the scheduler got a message it does not know: {message!r:.100}")

    # --- requests in ------------------------------------------------------------------------------

    def handle_generate_request(self, req: TokenizedGenerateReqInput) -> None:
        params = req.sampling_params
        if req.fill_max_new_tokens:  # no max_tokens: up to the end of the context
            params = dataclasses.replace(params, max_new_tokens=max(1, self.context_len - len(req.input_ids) + 1))
        # BEGIN EXERCISE: add the request to the engine (token ids, params, rid) and remember its Req in self.reqs; a ValueError means it can never be served: send an ErrorOut (status 400, the error's message) to the detokenizer instead
        try:
            self.reqs[req.rid] = self.engine.add_request(req.input_ids, params, rid=req.rid)
        except ValueError as error:
            self.send_to_detokenizer.send_pyobj(ErrorOut(req.rid, str(error), 400))
        # END EXERCISE

    def abort_request(self, rid: str) -> None:
        """The client went away: end the request now (its KV is freed) and tell the detokenizer
        to forget it. A request that already finished is gone: nothing to do."""
        # BEGIN EXERCISE: if the engine aborts it (engine.abort_request returns True), drop it from self.reqs and send a BatchTokenIDOut with no new tokens and FinishReason("abort") so the detokenizer forgets it
        if self.engine.abort_request(rid):
            req = self.reqs.pop(rid)
            self.send_to_detokenizer.send_pyobj(BatchTokenIDOut(
                [rid], [[]], [FinishReason("abort")], [len(req.origin_input_ids)], [len(req.output_ids)],
                [req.sampling_params.stop]))
        # END EXERCISE

    # --- outputs out ------------------------------------------------------------------------------

    def send_outputs(self, outputs) -> None:
        """One step's TokenOutputs as one BatchTokenIDOut; finished requests are forgotten."""
        if not outputs:
            return
        batch = BatchTokenIDOut([], [], [], [], [], [])
        for out in outputs:
            req = self.reqs[out.rid] if out.finish_reason is None else self.reqs.pop(out.rid)
            batch.rids.append(out.rid)
            batch.new_token_ids.append(list(out.new_token_ids))
            batch.finish_reasons.append(out.finish_reason)
            batch.prompt_tokens.append(len(req.origin_input_ids))
            batch.completion_tokens.append(len(req.output_ids))
            batch.stops.append(req.sampling_params.stop)
        self.send_to_detokenizer.send_pyobj(batch)

    def debug_state(self) -> dict[str, Any]:
        """Counts and the invariant checks, between two steps (for /debug/state)."""
        scheduler, allocator = self.engine.scheduler, self.engine.runner.allocator
        tree = getattr(self.engine, "tree_cache", None)
        state = {
            "running": len(scheduler.running), "waiting": len(scheduler.waiting), "tracked_requests": len(self.reqs),
            "pool_size": allocator.size, "free_slots": allocator.available_size(),
            "tree_cached_tokens": tree.total_size() if tree is not None else 0,
            "tree_locked_tokens": tree.protected_size_ if tree is not None else 0,
            "steps": scheduler.stats.steps, "context_len": self.context_len,
            # where and how the passes run: e.g. "cuda:0", "torch.bfloat16", {"eager": 12, "graph": 340}
            "device": str(self.engine.model.device), "dtype": str(self.engine.model.dtype),
            "forward_paths": dict(self.engine.runner.forward_paths),
        }
        try:
            scheduler.check_invariants()
            if tree is not None:
                tree.check()
            state["invariants"] = "ok"
        except AssertionError as error:
            state["invariants"] = str(error)
        return state


def run_scheduler_process(server_args, ipc, ready) -> None:
    """The scheduler process: build the engine, PULL from the tokenizer, PUSH to the detokenizer."""
    engine = build_engine(server_args.model, server_args.engine_knobs)
    context = zmq.Context()
    recv_from_tokenizer = context.socket(zmq.PULL)
    recv_from_tokenizer.bind(ipc.scheduler)
    send_to_detokenizer = context.socket(zmq.PUSH)
    send_to_detokenizer.connect(ipc.detokenizer)
    scheduler = SchedulerProcess(engine, recv_from_tokenizer, send_to_detokenizer)
    ready({"context_len": scheduler.context_len, "device": str(engine.model.device)})
    scheduler.event_loop()
