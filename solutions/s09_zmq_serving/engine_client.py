"""``EngineClient``: the API server's end of the pipeline, and one queue per request in flight.

One PUSH socket carries every request (and abort) to the tokenizer worker. One reader task, for
the whole server, takes everything the workers send back (text pieces from the detokenizer,
errors, debug answers) and drops each into its request's ``asyncio.Queue``; a request's handler
reads only its own queue, watching meanwhile whether its client is still there and whether its
time is up::

    handler ──GenerateReqInput──▶ tokenizer ─▶ scheduler ─▶ detokenizer ──BatchStrOut──▶ reader task
       ▲                                                                                    │
       └──────────────────── queues[rid] (OutputPiece items) ◀──────────────────────────────┘

A request leaves the table when its last piece (or an error) arrives, or when it is aborted: a
client that went away, a request past its time. The table's size is what the queue cap counts.
With ``--enable-metrics`` the same three places tell ``ServerMetrics`` (metrics.py): the moment
each piece arrived, and each request that ended without its last piece.

An API request with ``n`` choices is n engine requests (n rids) sharing one queue: each piece
names its rid, and the handler reads until every one of them has finished.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import AsyncIterator

import zmq
import zmq.asyncio
from fastapi import Request

from .io_struct import AbortReq, BatchStrOut, DebugStateOut, EngineStateOut, ErrorOut, LogprobEntry
from .metrics import ServerMetrics
from .protocol import RETRY_AFTER_S, InvalidRequest

DISCONNECT_POLL_S = 0.2  # while a request waits for its answer, look this often whether its client left


@dataclass
class OutputPiece:
    """One piece of one request's answer, as its handler reads it from its queue."""

    rid: str  # the engine request (one choice of the API request) it belongs to
    text: str
    finish_reason: str | None  # "stop" / "length" on the last piece
    prompt_tokens: int
    completion_tokens: int  # its engine request's so far (outputs() sums the request's choices)
    logprobs: list[LogprobEntry]  # the entries of this piece's tokens (a request that asked for them)


def rejection(error: ErrorOut, kind: str = "completion", grammar_param: str | None = None) -> InvalidRequest:
    """A worker's ErrorOut as the exception the app turns into OpenAI's error answer, naming the
    request's own field: a prompt too long for the engine is refused as the "prompt"
    (ErrorOut.refused), and a chat's prompt is its ``messages``; a grammar the scheduler gave up on
    is reported as "response_format", and ``grammar_param`` says where it came from instead (a
    forced tool call's: "tool_choice")."""
    param = error.param
    if param == "prompt" and kind == "chat":
        param = "messages"
    elif param == "response_format" and grammar_param is not None:
        param = grammar_param
    return InvalidRequest(
        error.message,
        param=param,
        status_code=error.status_code,
        type="invalid_request_error" if error.status_code < 500 else "server_error",
        code=error.code,
    )


class ClientGone(Exception):
    """The HTTP client closed its connection before its answer was complete."""


class EngineClient:
    """The API server's end of the sockets, and one queue per request in flight."""

    def __init__(self, ipc, metrics: ServerMetrics | None = None):
        self.metrics = metrics
        self.send_to_tokenizer = zmq.Context.instance().socket(zmq.PUSH)
        self.send_to_tokenizer.connect(ipc.tokenizer)
        self.recv_from_workers = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self.recv_from_workers.bind(ipc.api_server)
        self.queues: dict[str, asyncio.Queue] = {}
        self.fatal: ErrorOut | None = None  # set when the server cannot serve any more: every request then fails

    def send(self, message) -> None:
        # A PUSH socket queues locally, so this never waits on the tokenizer.
        self.send_to_tokenizer.send_pyobj(message)

    async def reader_loop(self) -> None:
        """Forever: route every message from the workers to its request's queue."""
        while True:
            message = await self.recv_from_workers.recv_pyobj()
            if isinstance(message, BatchStrOut):
                now = asyncio.get_running_loop().time()
                for i, rid in enumerate(message.rids):
                    finish = message.finish_reasons[i]
                    if self.metrics is not None:
                        self.metrics.piece(rid, message.prompt_tokens[i], message.completion_tokens[i], finish, now)
                    queue = self.queues.pop(rid, None) if finish is not None else self.queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(
                            OutputPiece(
                                rid,
                                message.texts[i],
                                finish,
                                message.prompt_tokens[i],
                                message.completion_tokens[i],
                                message.logprobs[i],
                            )
                        )
            elif isinstance(message, (ErrorOut, EngineStateOut, DebugStateOut)):
                queue = self.queues.pop(message.rid, None)
                if queue is not None:
                    queue.put_nowait(message)
                if isinstance(message, ErrorOut):
                    self.ended([message.rid], "error")
                    # An error ends the request everywhere: if it came from the detokenizer the
                    # scheduler still runs it (an abort of a request it no longer has is a no-op).
                    self.send(AbortReq(message.rid))

    def fail_all(self, message: str, status: int = 500) -> None:
        """Answer every request in flight, and every later one, with ``message`` (on the event
        loop): a worker died (500), or the server is shutting down (503)."""
        self.fatal = ErrorOut("", message, status)
        for rid, queue in self.queues.items():
            queue.put_nowait(ErrorOut(rid, message, status))
        self.ended(list(self.queues), "error")
        self.queues.clear()

    def ended(self, rids: list[str], reason: str) -> None:
        """For the metrics: ``rids`` ended without their last piece (a no-op for a rid that had it)."""
        if self.metrics is not None:
            for rid in rids:
                self.metrics.end(rid, reason)

    def open(self, rids: list[str], max_in_flight: int | None = None, arrived: float | None = None) -> asyncio.Queue:
        """One queue for the engine requests ``rids`` (an API request's choices), all of them
        counted against ``max_in_flight``: a request whose choices do not all fit is refused whole.
        ``arrived`` (loop time): they are requests for text, which the metrics time from then
        (questions to the workers are not timed)."""
        if self.fatal is not None:
            raise rejection(self.fatal)
        if max_in_flight is not None and len(self.queues) + len(rids) > max_in_flight:
            raise InvalidRequest(
                f"the server is overloaded: {len(self.queues)} requests are in flight, the most it "
                f"accepts; retry after {RETRY_AFTER_S} s",
                status_code=503,
                type="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        queue: asyncio.Queue = asyncio.Queue()
        for rid in rids:
            self.queues[rid] = queue
        if arrived is not None and self.metrics is not None:
            self.metrics.start(rids, arrived)
        return queue

    def abort(self, rids: list[str]) -> None:
        """End the engine requests ``rids`` that are still in flight (a no-op for the others)."""
        for rid in rids:
            if self.queues.pop(rid, None) is not None:
                self.send(AbortReq(rid))
        self.ended(rids, "abort")

    async def next_output(self, queue: asyncio.Queue, request: Request | None, deadline: float | None):
        """The next item of a request's queue. With ``request``, raise ClientGone if its client
        disconnects meanwhile (during a stream, Starlette itself cancels the handler instead);
        with ``deadline`` (the loop's clock), raise TimeoutError once it has passed."""
        loop = asyncio.get_running_loop()
        getter = asyncio.ensure_future(queue.get())
        try:
            while True:
                waits = ([DISCONNECT_POLL_S] if request is not None else []) + (
                    [max(0.0, deadline - loop.time())] if deadline is not None else []
                )
                done, _ = await asyncio.wait({getter}, timeout=min(waits) if waits else None)
                # Checked on every piece too: pieces may come faster than the poll interval.
                if request is not None and await request.is_disconnected():
                    raise ClientGone()
                if done:
                    return getter.result()
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError()
        finally:
            getter.cancel()

    async def outputs(
        self,
        rids: list[str],
        queue: asyncio.Queue,
        first,
        request: Request | None,
        deadline: float | None,
        prompt_of: dict[str, int] | None = None,
    ) -> AsyncIterator[OutputPiece]:
        """The answer of the engine requests ``rids`` (sharing ``queue``), piece by piece as they
        come (starting with ``first``), until every one has finished. Each piece's counts are the
        whole API request's so far: every choice's completion_tokens, and each prompt's tokens once
        (``prompt_of``: which prompt of a batch each rid answers; by default they share one), so
        the last piece holds its usage. A worker error raises InvalidRequest."""
        running, generated, prompts, item = set(rids), {}, {}, first
        while True:
            if isinstance(item, ErrorOut):
                raise rejection(item)
            generated[item.rid] = item.completion_tokens
            prompts[(prompt_of or {}).get(item.rid, 0)] = item.prompt_tokens
            yield replace(item, completion_tokens=sum(generated.values()), prompt_tokens=sum(prompts.values()))
            if item.finish_reason is not None:
                running.discard(item.rid)
                if not running:
                    return
            item = await self.next_output(queue, request, deadline)
