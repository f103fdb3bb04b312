"""The API server: OpenAI's HTTP API (FastAPI, run by uvicorn) in front of the other processes.

    POST /v1/chat/completions   POST /v1/completions   (streaming or not)
    GET  /v1/models             GET  /health           GET /debug/state

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
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .io_struct import AbortReq, BatchStrOut, DebugStateOut, DebugStateReq, ErrorOut, GenerateReqInput
from .protocol import (
    ChatCompletionRequest, CompletionRequest, InvalidRequest, chat_chunk, chat_completion, chat_messages,
    check_supported, completion, completion_chunk, completion_prompt, error_body, new_id, to_sampling_params, usage,
)

FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
UNION_TAGS = {"float", "int", "str", "bool"}  # how pydantic names the member of a union it tried
DISCONNECT_POLL_S = 0.2  # while a request waits for its answer, look this often whether its client left
CLIENT_CLOSED_REQUEST = 499  # the status logged for a request whose client left (nginx's convention)


@dataclass
class OutputPiece:
    """One piece of one request's answer, as its handler reads it from its queue."""

    text: str
    finish_reason: str | None  # "stop" / "length" on the last piece
    prompt_tokens: int
    completion_tokens: int


def rejection(error: ErrorOut) -> InvalidRequest:
    """A worker's ErrorOut as the exception the app turns into OpenAI's error answer."""
    return InvalidRequest(error.message, param=error.param, status_code=error.status_code,
                          type="invalid_request_error" if error.status_code < 500 else "server_error")


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
        self.fatal: str | None = None  # set when a worker process died: every request then fails

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
                        queue.put_nowait(OutputPiece(message.texts[i], finish, message.prompt_tokens[i],
                                                     message.completion_tokens[i]))
            elif isinstance(message, (ErrorOut, DebugStateOut)):
                queue = self.queues.pop(message.rid, None)
                if queue is not None:
                    queue.put_nowait(message)

    def fail_all(self, message: str) -> None:
        """A worker died: answer every waiting request with the reason (on the event loop)."""
        self.fatal = message
        for queue in self.queues.values():
            queue.put_nowait(ErrorOut("", message, 500))
        self.queues.clear()

    def open(self, rid: str) -> asyncio.Queue:
        if self.fatal is not None:
            raise InvalidRequest(self.fatal, status_code=500, type="server_error")
        queue = self.queues[rid] = asyncio.Queue()
        return queue

    def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None:  # still in flight
            self.send(AbortReq(rid))

    async def next_output(self, queue: asyncio.Queue, request: Request | None):
        """The next item of a request's queue. With ``request``, raise ClientGone if its client
        disconnects meanwhile (during a stream, Starlette itself cancels the handler instead)."""
        if request is None:
            return await queue.get()
        getter = asyncio.ensure_future(queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                # Checked on every piece too: pieces may come faster than the poll interval.
                if await request.is_disconnected():
                    raise ClientGone()
                if done:
                    return getter.result()
        finally:
            getter.cancel()

    async def outputs(self, rid: str, queue: asyncio.Queue, first, request: Request | None) -> AsyncIterator[OutputPiece]:
        """A request's answer, piece by piece (starting with ``first``), until it is finished.
        A worker error after the start raises InvalidRequest."""
        item = first
        while True:
            if isinstance(item, ErrorOut):
                raise rejection(item)
            yield item
            if item.finish_reason is not None:
                return
            item = await self.next_output(queue, request)


def sse(data: dict | str) -> str:
    """One Server-Sent Event: ``data: <payload>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_chunks(outputs: AsyncIterator[OutputPiece], make_chunk: Callable[..., dict],
                        include_usage: bool) -> AsyncIterator[str]:
    """The SSE lines of a streamed answer. ``make_chunk(text, finish_reason, usage)`` builds one
    chunk: ``text=None`` is the usage-only chunk, ``text=""`` with a finish reason the last one."""
    raise NotImplementedError("Stage 9: for each output: a chunk with its text if it has any, and when it finishes a chunk (\"\" and the finish reason); then, with include_usage, the usage-only chunk (text None, usage(prompt_tokens, completion_tokens) of the last output); always end with \"data: [DONE]\"; every line through sse() - see stages/s09_zmq_serving/README.md")


def create_app(model_names: list[str], ipc, context_len: int, pids: dict[str, int],
               dead_child: Callable[[], str | None] = lambda: None) -> FastAPI:
    """The FastAPI app; ``model_names[0]`` is the name /v1/models lists; ``dead_child()`` says
    why a worker process is gone (None while all live)."""
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = state["client"] = EngineClient(ipc)
        state["loop"] = asyncio.get_running_loop()
        reader = asyncio.create_task(client.reader_loop())
        yield
        reader.cancel()

    app = FastAPI(title="build-an-inference-engine, stage 9", lifespan=lifespan)
    app.state.engine = state  # the launcher reaches the client and the loop through this

    def error_response(status: int, message: str, type: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
        return JSONResponse(error_body(message, type, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        # FastAPI says 422 with its own body; OpenAI clients expect 400 and OpenAI's error body.
        first = exc.errors()[0]
        loc = []
        for part in first.get("loc", ())[1:]:  # loc[0] is "body"
            if isinstance(part, str) and (part in UNION_TAGS or not FIELD_NAME.fullmatch(part)):
                break  # pydantic names the union member it tried ("float", "list[str]"): not a field
            loc.append(str(part))
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        where = ".".join(loc) or "body"
        message = f"{where}: {first['msg']}" + (f" (got {first['input']!r:.80})" if "input" in first and loc else "")
        return error_response(400, message, param=where if loc else None)

    @app.exception_handler(InvalidRequest)
    async def on_invalid_request(request: Request, exc: InvalidRequest):
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        if isinstance(exc, NotImplementedError) and str(exc).startswith("Stage "):
            return error_response(500, f"not written yet -> {exc}", "server_error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def check_model(name: str) -> str:
        if name not in model_names:
            raise InvalidRequest(f"The model `{name}` does not exist; this server serves {model_names[0]!r} (see /v1/models)",
                                 param="model", status_code=404, code="model_not_found")
        return model_names[0]

    async def generate(request: Request, req: GenerateReqInput, stream: bool, include_usage: bool,
                       model: str, kind: str):
        client: EngineClient = state["client"]
        queue = client.open(req.rid)
        client.send(req)
        try:
            # Wait for the first piece before answering: a request the scheduler rejects (too
            # long a prompt) then gets a proper 400, not a 200 stream that carries an error.
            first = await client.next_output(queue, request)
        except ClientGone:
            client.abort(req.rid)
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
        except asyncio.CancelledError:
            client.abort(req.rid)
            raise
        if isinstance(first, ErrorOut):
            raise rejection(first)
        outputs = client.outputs(req.rid, queue, first, None if stream else request)
        if not stream:
            pieces, last = [], None
            try:
                async for out in outputs:
                    pieces.append(out.text)
                    last = out
            except ClientGone:
                client.abort(req.rid)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
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
            except InvalidRequest as error:  # a worker died mid-stream: say so in the stream
                yield sse(error.body())
            except NotImplementedError as error:  # an exercise of this stage not written yet
                yield sse(error_body(f"not written yet -> {error}", "server_error"))
                raise
            finally:
                client.abort(req.rid)  # a no-op unless it is still in flight (the client went away)

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = check_model(body.model)
        check_supported(body)
        messages = chat_messages(body)
        params, fill = to_sampling_params(body)
        req = GenerateReqInput(new_id("chatcmpl"), params, messages=messages, fill_max_new_tokens=fill)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await generate(request, req, body.stream, include_usage, model, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model = check_model(body.model)
        check_supported(body)
        text, ids = completion_prompt(body)
        params, fill = to_sampling_params(body)
        req = GenerateReqInput(new_id("cmpl"), params, text=text, input_ids=ids, fill_max_new_tokens=fill)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await generate(request, req, body.stream, include_usage, model, "completion")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_names[0], "object": "model", "created": 0,
                                            "owned_by": "build-an-inference-engine", "max_model_len": context_len}]}

    @app.get("/health")
    async def health():
        client: EngineClient = state["client"]
        why = client.fatal or dead_child()
        if why is not None:
            return error_response(503, why, "server_error")
        return {"status": "ok"}

    @app.get("/debug/state")
    async def debug_state():
        """The scheduler's counts and invariant checks (taken between two steps), and the pids."""
        client: EngineClient = state["client"]
        rid = new_id("debug")
        queue = client.open(rid)
        client.send(DebugStateReq(rid))
        answer = await asyncio.wait_for(queue.get(), timeout=60)
        if isinstance(answer, ErrorOut):
            return error_response(answer.status_code, answer.message, "server_error")
        return {**answer.state, "open_requests": len(client.queues), "pids": pids}

    return app
