"""The API server: OpenAI's HTTP API (FastAPI, run by uvicorn) in front of the other processes.

    POST /v1/chat/completions   POST /v1/completions   (streaming or not)
    GET  /v1/models             GET  /health
    GET  /debug/state           POST /debug/fault      (only with --enable-debug-endpoints)

A request is validated here (``protocol.py``), given a request id, and sent to the tokenizer
worker; its answers come back, a text piece at a time, from the detokenizer. One task reads that
socket for the whole server and drops each piece into its request's ``asyncio.Queue``; the
handler of the request reads its own queue::

    handler ──GenerateReqInput──▶ tokenizer ─▶ scheduler ─▶ detokenizer ──BatchStrOut──▶ reader task
       ▲                                                                                    │
       └──────────────────── queues[rid] (OutputPiece items) ◀──────────────────────────────┘

Streaming answers are Server-Sent Events: one ``data: {json chunk}`` line (and a blank line)
per piece, then ``data: [DONE]``. A client that goes away (the connection closes) has its
request aborted: the scheduler frees its KV before its next step.

Before any of that, the guards (README, "What can go wrong in a server"): ``RequestGuard``
(``request_guard.py``) checks the API key and reads the body under a size cap and a time limit
before anything parses it; a request beyond the queue cap is answered 503 with Retry-After;
every answer, even an error about a string that cannot be encoded, renders as OpenAI's JSON
(``http_errors.py``); a request past --request-timeout is aborted; /health reads the workers'
heartbeats; and when the server stops, every request in flight is told so (a stream gets a last
SSE error event, then ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Literal

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .http_errors import OpenAIJSONResponse, error_response, install_error_handlers, json_bytes
from .io_struct import (
    AbortReq,
    BatchStrOut,
    DebugFaultReq,
    DebugStateOut,
    DebugStateReq,
    ErrorOut,
    GenerateReqInput,
)
from .protocol import (  # noqa: F401
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    Limits,
    chat_chunk,
    chat_completion,
    chat_messages,
    check_limits,
    check_supported,
    completion,
    completion_chunk,
    completion_prompt,
    error_body,
    new_id,
    to_sampling_params,
    usage,
)
from .request_guard import RequestGuard
from .server_args import ServerArgs
from .worker_loop import INJECTED, Heartbeats

DISCONNECT_POLL_S = 0.2  # while a request waits for its answer, look this often whether its client left
CLIENT_CLOSED_REQUEST = 499  # the status logged for a request whose client left (nginx's convention)
RETRY_AFTER_S = 1  # what an overloaded server asks a client to wait before trying again
SHUTTING_DOWN = "the server is shutting down; the request was cut short"


@dataclass
class OutputPiece:
    """One piece of one request's answer, as its handler reads it from its queue."""

    text: str
    finish_reason: str | None  # "stop" / "length" on the last piece
    prompt_tokens: int
    completion_tokens: int


def rejection(error: ErrorOut, kind: str = "completion") -> InvalidRequest:
    """A worker's ErrorOut as the exception the app turns into OpenAI's error answer. A prompt too
    long for the engine is refused as the "prompt" (ErrorOut.refused); a chat's prompt is its
    ``messages``."""
    param = "messages" if error.param == "prompt" and kind == "chat" else error.param
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

    def __init__(self, ipc):
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
                for i, rid in enumerate(message.rids):
                    finish = message.finish_reasons[i]
                    queue = self.queues.pop(rid, None) if finish is not None else self.queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(
                            OutputPiece(
                                message.texts[i], finish, message.prompt_tokens[i], message.completion_tokens[i]
                            )
                        )
            elif isinstance(message, (ErrorOut, DebugStateOut)):
                queue = self.queues.pop(message.rid, None)
                if queue is not None:
                    queue.put_nowait(message)
                if isinstance(message, ErrorOut):
                    # An error ends the request everywhere: if it came from the detokenizer the
                    # scheduler still runs it (an abort of a request it no longer has is a no-op).
                    self.send(AbortReq(message.rid))

    def fail_all(self, message: str, status: int = 500) -> None:
        """Answer every request in flight, and every later one, with ``message`` (on the event
        loop): a worker died (500), or the server is shutting down (503)."""
        self.fatal = ErrorOut("", message, status)
        for rid, queue in self.queues.items():
            queue.put_nowait(ErrorOut(rid, message, status))
        self.queues.clear()

    def open(self, rid: str, max_in_flight: int | None = None) -> asyncio.Queue:
        if self.fatal is not None:
            raise rejection(self.fatal)
        if max_in_flight is not None and len(self.queues) >= max_in_flight:
            raise InvalidRequest(
                f"the server is overloaded: {len(self.queues)} requests are in flight, the most it "
                f"accepts; retry after {RETRY_AFTER_S} s",
                status_code=503,
                type="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        queue = self.queues[rid] = asyncio.Queue()
        return queue

    def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None:  # still in flight
            self.send(AbortReq(rid))

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
                done, _ = await asyncio.wait({getter}, timeout=min(waits) if waits else None)  # noqa: F841
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
        self, rid: str, queue: asyncio.Queue, first, request: Request | None, deadline: float | None
    ) -> AsyncIterator[OutputPiece]:
        """A request's answer, piece by piece (starting with ``first``), until it is finished.
        A worker error after the start raises InvalidRequest."""
        item = first
        while True:
            if isinstance(item, ErrorOut):
                raise rejection(item)
            yield item
            if item.finish_reason is not None:
                return
            item = await self.next_output(queue, request, deadline)


def sse(data: dict | str) -> str:
    """One Server-Sent Event: ``data: <payload>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json_bytes(data).decode()}\n\n"


async def stream_chunks(
    outputs: AsyncIterator[OutputPiece], make_chunk: Callable[..., dict], include_usage: bool
) -> AsyncIterator[str]:
    """The SSE lines of a streamed answer. ``make_chunk(text, finish_reason, usage)`` builds one
    chunk: ``text=None`` is the usage-only chunk, ``text=""`` with a finish reason the last one."""
    raise NotImplementedError(
        "Stage 9: the stream's chunks for these outputs (text, finish, usage) - see stages/s09_zmq_serving/README.md#streaming-sse"  # noqa: E501 (one message, the learner's to read whole)
    )
    yield  # keeps stream_chunks a generator, as the solution is


class DebugFault(BaseModel):
    """POST /debug/fault: the next request ``process`` handles raises or stalls (tests only)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    process: Literal["api_server", "tokenizer", "scheduler", "detokenizer"]
    kind: Literal["raise", "stall"] = "raise"
    seconds: float = Field(0.0, ge=0, le=600)


def create_app(
    server_args: ServerArgs,
    limits: Limits,
    max_running_requests: int,
    ipc,
    pids: dict[str, int],
    dead_child: Callable[[], str | None] = lambda: None,
    heartbeats: Heartbeats | None = None,
) -> FastAPI:
    """The FastAPI app. ``limits``: what the model allows (protocol.Limits); ``dead_child()``
    says why a worker process is gone (None while all live); ``heartbeats``: the workers' (for /health)."""
    state: dict = {}
    model_names = server_args.model_names()
    max_in_flight = max_running_requests + server_args.max_queued_requests

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = state["client"] = EngineClient(ipc)
        state["loop"] = asyncio.get_running_loop()
        reader = asyncio.create_task(client.reader_loop())
        yield
        reader.cancel()

    app = FastAPI(
        title="build-an-inference-engine, stage 9", lifespan=lifespan, default_response_class=OpenAIJSONResponse
    )
    app.state.engine = state  # the launcher reaches the client and the loop through this
    app.add_middleware(
        RequestGuard,
        max_bytes=server_args.max_request_bytes,
        read_timeout=server_args.read_timeout,
        api_key=server_args.api_key,
    )
    install_error_handlers(app)

    def check_model(name: str) -> str:
        if name not in model_names:
            raise InvalidRequest(
                f"The model {name!r} does not exist; this server serves {model_names[0]!r} (see /v1/models)",
                param="model",
                status_code=404,
                code="model_not_found",
            )
        return model_names[0]

    async def generate(
        request: Request, req: GenerateReqInput, stream: bool, include_usage: bool, model: str, kind: str
    ):
        client: EngineClient = state["client"]
        loop = asyncio.get_running_loop()
        deadline = None if server_args.request_timeout is None else loop.time() + server_args.request_timeout
        queue = client.open(req.rid, max_in_flight)
        client.send(req)
        timed_out = InvalidRequest(
            f"the request took longer than {server_args.request_timeout} s (--request-timeout); it was aborted",
            status_code=504,
            type="server_error",
            code="request_timeout",
        )
        try:
            # Wait for the first piece before answering: a request the scheduler rejects (too
            # long a prompt) then gets a proper 400, not a 200 stream that carries an error.
            first = await client.next_output(queue, request, deadline)
        except ClientGone:
            client.abort(req.rid)
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
        except TimeoutError:
            client.abort(req.rid)
            raise timed_out from None
        except asyncio.CancelledError:
            client.abort(req.rid)
            raise
        if isinstance(first, ErrorOut):
            raise rejection(first, kind)
        outputs = client.outputs(req.rid, queue, first, None if stream else request, deadline)
        if not stream:
            pieces, last = [], None
            try:
                async for out in outputs:
                    pieces.append(out.text)
                    last = out
            except ClientGone:
                client.abort(req.rid)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            except TimeoutError:
                client.abort(req.rid)
                raise timed_out from None
            make = chat_completion if kind == "chat" else completion
            return make(req.rid, model, "".join(pieces), last.finish_reason, last.prompt_tokens, last.completion_tokens)

        created = int(time.time())

        def make_chunk(text, finish_reason, usage_):
            if kind == "chat":
                delta = None if text is None else ({"content": text} if text else {})
                return chat_chunk(req.rid, model, created, delta, finish_reason, usage_)
            return completion_chunk(req.rid, model, created, text, finish_reason, usage_)

        async def body():
            try:
                if kind == "chat":  # OpenAI's first chunk names the role
                    yield sse(chat_chunk(req.rid, model, created, {"role": "assistant", "content": ""}))
                async for line in stream_chunks(outputs, make_chunk, include_usage):
                    yield line
            # Cut short (a worker's error, the server stopping, the time limit): a last event
            # with OpenAI's error body, and the stream still ends properly, so a client knows.
            except InvalidRequest as error:
                yield sse(error.body())
                yield sse("[DONE]")
            except TimeoutError:
                yield sse(timed_out.body())
                yield sse("[DONE]")
            except NotImplementedError as error:  # an exercise of this stage not written yet
                yield sse(error_body(f"not written yet -> {error}", "server_error"))
                raise
            finally:
                client.abort(req.rid)  # a no-op unless it is still in flight (the client went away)

        return StreamingResponse(body(), media_type="text/event-stream")

    async def constrain(params, response_format: dict | None, regex: str | None):
        """response_format and regex need stage 11's engine (structured output): imported here,
        only when a request asks for them, so this stage alone serves everything else."""
        if response_format in (None, {"type": "text"}) and regex is None:
            return params
        if server_args.engine_knobs.get("disable_overlap"):
            raise InvalidRequest(
                "response_format and regex need stage 11's engine; this server runs stage 8's (--disable-overlap)",
                param="regex" if regex is not None else "response_format",
            )
        from s11_structured_output.response_format import structured_params

        return await structured_params(params, response_format, regex)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_limits(body, limits)
        model = check_model(body.model)
        check_supported(body)
        messages = chat_messages(body)
        params, fill = to_sampling_params(body)
        params = await constrain(params, body.response_format, body.regex)
        req = GenerateReqInput(new_id("chatcmpl"), params, messages=messages, fill_max_new_tokens=fill)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await generate(request, req, body.stream, include_usage, model, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_limits(body, limits)
        model = check_model(body.model)
        check_supported(body)
        text, ids = completion_prompt(body)
        params, fill = to_sampling_params(body)
        params = await constrain(params, None, body.regex)
        req = GenerateReqInput(new_id("cmpl"), params, text=text, input_ids=ids, fill_max_new_tokens=fill)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await generate(request, req, body.stream, include_usage, model, "completion")

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "build-an-inference-engine",
            "max_model_len": limits.context_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(model_names[0])]}

    @app.get("/v1/models/{name:path}")  # the openai client's models.retrieve; a hub id has a "/"
    async def model(name: str):
        return model_card(check_model(name))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health():
        client: EngineClient = state["client"]
        why = client.fatal.message if client.fatal is not None else dead_child()
        if why is None and client.queues and heartbeats is not None:
            stuck = {name: age for name, age in heartbeats.ages().items() if age > server_args.health_timeout}
            if stuck:
                why = "; ".join(
                    f"the {name} has not come round its loop for {age:.0f} s" for name, age in stuck.items()
                ) + (
                    f" while {len(client.queues)} request(s) are in flight (--health-timeout "
                    f"{server_args.health_timeout:g} s)"
                )
        if why is not None:
            return error_response(503, why, "server_error")
        return {"status": "ok"}

    if server_args.enable_debug_endpoints:

        async def ask_workers(message) -> dict:
            client: EngineClient = state["client"]
            queue = client.open(message.rid)
            client.send(message)
            try:
                answer = await asyncio.wait_for(queue.get(), timeout=60)
            finally:
                client.queues.pop(message.rid, None)
            if isinstance(answer, ErrorOut):
                raise rejection(answer)
            return answer.state

        @app.get("/debug/state")
        async def debug_state():
            """The scheduler's counts and invariant checks (taken between two steps), and the pids."""
            client: EngineClient = state["client"]
            answer = await ask_workers(DebugStateReq(new_id("debug")))
            guards = {
                "max_request_bytes": server_args.max_request_bytes,
                "max_prompt_chars": limits.max_prompt_chars,
                "max_in_flight": max_in_flight,
                "request_timeout": server_args.request_timeout,
                "health_timeout": server_args.health_timeout,
                "heartbeat_ages": heartbeats.ages() if heartbeats else None,
            }
            return {**answer, "open_requests": len(client.queues), "pids": pids, "guards": guards}

        @app.post("/debug/fault")
        async def debug_fault(fault: DebugFault):
            """Arm a fault: the next request ``process`` handles raises or stalls (the guards' tests)."""
            if fault.process == "api_server":
                raise RuntimeError(INJECTED)  # this very request is the one that fails
            return await ask_workers(DebugFaultReq(new_id("fault"), fault.process, fault.kind, fault.seconds))

    return app
