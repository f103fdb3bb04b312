"""The API server: OpenAI's HTTP API (FastAPI, run by uvicorn) in front of the other processes.

    POST /v1/chat/completions   POST /v1/completions   (streaming or not)
    GET  /v1/models             GET  /health
    GET  /metrics                                      (only with --enable-metrics: metrics.py)
    GET  /debug/state           POST /debug/fault      (only with --enable-debug-endpoints)

A request is read and validated here (``protocol.py``; a large body off the event loop:
``body_reader.py``), given a request id, and sent on through the ``EngineClient``
(``engine_client.py``); its answer comes back a text piece at a time, on the request's own queue.
``OpenAIServing`` turns those pieces into OpenAI's answer: one JSON object, or a stream of
Server-Sent Events (one ``data: {json chunk}`` line and a blank line per piece, then
``data: [DONE]``). A client that goes away (the connection closes) has its request aborted:
the scheduler frees its KV before its next step.

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
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from s02_request_and_sampling.sampling_params import MAX_SEED

from .body_reader import BodyReader
from .engine_client import ClientGone, EngineClient, OutputPiece, rejection
from .http_errors import CLIENT_CLOSED_REQUEST, OpenAIJSONResponse, error_response, install_error_handlers, json_bytes
from .http_server import ConnectionLimit
from .io_struct import DebugFaultReq, DebugStateReq, EngineStateReq, ErrorOut, GenerateReqInput, LogprobEntry
from .metrics import HTTPRequestCounter, ServerMetrics
from .protocol import (  # noqa: F401
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    InvalidRequest,
    Limits,
    chat_messages,
    check_limits,
    check_supported,
    completion_prompts,
    error_body,
    new_id,
    stream_chunk,
    to_sampling_params,
    usage,
    whole_answer,
)
from .request_guard import RequestGuard
from .server_args import ServerArgs, served_stage
from .tool_calls import ToolCallParser, read_whole, resolve_tool_choice, stream_delta, tool_call_schema
from .worker_loop import IDLE_POLL_MS, INJECTED, Heartbeats

if TYPE_CHECKING:  # stage 11's, imported when a request first asks for a grammar
    from s11_structured_output.grammar_check import GrammarChecker

SHUTTING_DOWN = "the server is shutting down; the request was cut short"
METRICS_TIMEOUT_S = 10  # a scrape waits this long for the workers (Prometheus' own default scrape_timeout)


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
    yield  # keeps stream_chunks a generator until you write it; delete this line then


def choices_of(req: GenerateReqInput, n: int) -> list[GenerateReqInput]:
    """The engine requests of an API request with ``n`` choices: ``req`` itself for one; else n
    copies with rids of their own, choice i seeded with seed + i (so a seeded request with n
    choices reproduces, and its choices differ). The engine's radix cache computes their shared
    prompt once (stage 7 holds the copies back until the first one's prefill is in the tree)."""
    if n == 1:
        return [req]
    seed = req.sampling_params.seed
    return [
        replace(
            req,
            rid=f"{req.rid}-{i}",
            sampling_params=replace(req.sampling_params, seed=None if seed is None else (seed + i) % (MAX_SEED + 1)),
        )
        for i in range(n)
    ]


def whole_choices(rids: list[str], pieces: list[OutputPiece], asked: bool) -> tuple[list[Choice], tuple[int, int]]:
    """The choices of a whole answer from the pieces of its engine requests ``rids`` (in any
    order, as ``EngineClient.outputs`` gives them), and its (prompt, completion) token counts: the
    prompt once, every choice's tokens (the last piece's)."""
    choices = {rid: Choice("", None, [] if asked else None) for rid in rids}
    for piece in pieces:
        choice = choices[piece.rid]
        choice.text += piece.text
        choice.finish_reason = piece.finish_reason or choice.finish_reason
        if choice.logprobs is not None:
            choice.logprobs += piece.logprobs
    return [choices[rid] for rid in rids], (pieces[-1].prompt_tokens, pieces[-1].completion_tokens)


@dataclass
class AnswerPlan:
    """How an API request is answered, beside the engine requests it becomes."""

    id: str  # the answer's id (chatcmpl-..., cmpl-...)
    kind: Literal["chat", "completion"]  # which of OpenAI's shapes it takes
    model: str
    n: int  # choices per prompt
    stream: bool
    include_usage: bool  # a stream ends with a usage chunk
    arrived: float  # when it reached its route (loop time): the metrics time it from here
    tool_reader: Callable[[], ToolCallParser] | None = None  # a chat with tools: each choice's text is read for calls
    grammar_param: str | None = None  # where its grammar came from, if not response_format/regex (tool_choice)


class DebugFault(BaseModel):
    """POST /debug/fault: the next request ``process`` handles raises or stalls (tests only)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    process: Literal["api_server", "tokenizer", "scheduler", "detokenizer"]
    kind: Literal["raise", "stall"] = "raise"
    seconds: float = Field(0.0, ge=0, le=600)


def include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


class OpenAIServing:
    """The two generation endpoints (SGLang's OpenAIServingChat and OpenAIServingCompletion): a
    validated request becomes a ``GenerateReqInput``, its pieces one JSON answer or an SSE stream.
    ``client`` and ``loop`` are set when the app starts (the sockets need its event loop)."""

    def __init__(self, server_args: ServerArgs, limits: Limits, max_running_requests: int):
        self.server_args = server_args
        self.limits = limits
        self.model_names = server_args.model_names()
        self.max_in_flight = max_running_requests + server_args.max_queued_requests
        self.client: EngineClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics = ServerMetrics(self.model_names[0]) if server_args.enable_metrics else None
        self.grammar_checker: GrammarChecker | None = None
        self.body_reader = BodyReader()

    def fail_all_from_any_thread(self, message: str, status: int) -> None:
        """Answer every request in flight, and every later one, with ``message`` (the launcher's
        thread calls this when a worker dies or the server stops)."""
        if self.loop is not None and self.client is not None:
            self.loop.call_soon_threadsafe(self.client.fail_all, message, status)

    def check_model(self, name: str) -> str:
        if name not in self.model_names:
            raise InvalidRequest(
                f"The model {name!r} does not exist; this server serves {self.model_names[0]!r} (see /v1/models)",
                param="model",
                status_code=404,
                code="model_not_found",
            )
        return self.model_names[0]

    async def chat_completions(self, request: Request):
        arrived = asyncio.get_running_loop().time()  # the metrics time the request from here
        body = await self.body_reader.read(request, ChatCompletionRequest, partial(check_limits, limits=self.limits))
        model = self.check_model(body.model)
        check_supported(body)
        messages = chat_messages(body)
        params, fill = to_sampling_params(body)
        tool_choice = resolve_tool_choice(body)
        offered = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        tools = offered if tool_choice.mode != "none" else None  # under "none" the model is not told of them
        schema = tool_call_schema(tools or [], tool_choice)
        if schema is None:
            params = await self.constrain(params, body.response_format, body.regex)
        else:  # "required" or a named function: the answer is held to the tools' schemas (stage 11)
            try:
                params = await self.constrain(params, {"type": "json_schema", "json_schema": {"schema": schema}}, None)
            except InvalidRequest as error:
                if error.status_code != 400:  # not the tools' fault (every grammar check busy: a 503 to retry)
                    raise
                shown = tool_choice.name or tool_choice.mode
                raise InvalidRequest(f"tool_choice {shown!r}: {error.message}", param="tool_choice") from None
        req = GenerateReqInput(new_id("chatcmpl"), params, messages=messages, tools=tools, fill_max_new_tokens=fill)
        names = [tool["function"]["name"] for tool in tools or ()]
        reader = None if tools is None else (lambda: ToolCallParser(tool_choice, names))
        plan = AnswerPlan(
            req.rid,
            "chat",
            model,
            body.n or 1,
            body.stream,
            include_usage(body),
            arrived,
            reader,
            grammar_param="tool_choice" if schema is not None else None,
        )
        return await self.generate(request, plan, [req])

    async def completions(self, request: Request):
        arrived = asyncio.get_running_loop().time()
        body = await self.body_reader.read(request, CompletionRequest, partial(check_limits, limits=self.limits))
        model = self.check_model(body.model)
        check_supported(body)
        prompts = completion_prompts(body)
        params, fill = to_sampling_params(body)
        if body.echo and params.logprobs is not None:  # the echoed prompt comes with its own entries
            params = replace(params, prompt_logprobs=params.logprobs)
        params = await self.constrain(params, None, body.regex)
        rid = new_id("cmpl")
        reqs = [
            GenerateReqInput(
                rid if len(prompts) == 1 else f"{rid}-p{i}",
                params,
                text=text,
                input_ids=ids,
                fill_max_new_tokens=fill,
                echo=body.echo,
            )
            for i, (text, ids) in enumerate(prompts)
        ]
        plan = AnswerPlan(rid, "completion", model, body.n or 1, body.stream, include_usage(body), arrived)
        return await self.generate(request, plan, reqs)

    async def constrain(self, params, response_format: dict | None, regex: str | None):
        """response_format and regex need stage 11's engine (structured output): imported here,
        only when a request asks for them, so this stage alone serves everything else."""
        if response_format in (None, {"type": "text"}) and regex is None:
            return params
        if served_stage(self.server_args.engine_knobs) == 8:
            raise InvalidRequest(
                "a constrained answer (response_format, regex, tool_choice 'required' or a named function) needs "
                "stage 11's engine; this server runs stage 8's (--disable-overlap)",
                param="regex" if regex is not None else "response_format",
            )
        from s11_structured_output.grammar_check import GrammarChecker
        from s11_structured_output.response_format import structured_params

        if self.grammar_checker is None:  # its worker processes start with the first constrained request
            self.grammar_checker = GrammarChecker()
        return await structured_params(params, response_format, regex, self.grammar_checker)

    def timed_out(self) -> InvalidRequest:
        return InvalidRequest(
            f"the request took longer than {self.server_args.request_timeout} s (--request-timeout); it was aborted",
            status_code=504,
            type="server_error",
            code="request_timeout",
        )

    async def generate(self, request: Request, plan: AnswerPlan, prompts: list[GenerateReqInput]):
        """Send each of ``prompts`` on (as ``plan.n`` engine requests, one per choice: choice i * n + j
        is prompt i's j-th) and answer as ``plan`` says with what comes back: the whole answer, or a
        stream."""
        client = self.client
        assert client is not None, "the app has not started"
        asked = prompts[0].sampling_params.logprobs is not None
        timeout = self.server_args.request_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        n = plan.n
        if len(prompts) * n > self.max_in_flight:  # never servable: not a 503 to retry forever
            raise InvalidRequest(
                f"{len(prompts)} prompt(s) x n={n} make {len(prompts) * n} engine requests, more than this server "
                f"runs and queues at once ({self.max_in_flight}); send fewer prompts or a smaller n",
                param="n" if n > 1 else "prompt",
            )
        groups = [choices_of(prompt, n) for prompt in prompts]
        reqs = [r for group in groups for r in group]
        rids = [r.rid for r in reqs]
        prompt_of = {r.rid: i for i, group in enumerate(groups) for r in group}  # usage counts each prompt once
        queue = client.open(rids, self.max_in_flight, arrived=plan.arrived)
        for r in reqs:
            client.send(r)
        try:
            # Wait for the first piece before answering: a request the scheduler rejects (too
            # long a prompt) then gets a proper 400, not a 200 stream that carries an error.
            first = await client.next_output(queue, request, deadline)
            if isinstance(first, ErrorOut):
                raise rejection(first, plan.kind, plan.grammar_param)
            if not plan.stream:
                pieces = [out async for out in client.outputs(rids, queue, first, request, deadline, prompt_of)]
                choices, counts = whole_choices(rids, pieces, asked)
                if plan.tool_reader is not None:
                    choices = [read_whole(choice, plan.tool_reader()) for choice in choices]
                return whole_answer(plan.kind, plan.id, plan.model, choices, counts)
        except ClientGone:
            client.abort(rids)
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
        except TimeoutError:
            client.abort(rids)
            raise self.timed_out() from None
        except (asyncio.CancelledError, InvalidRequest):  # (an error of one choice ends the others)
            client.abort(rids)
            raise
        # During a stream Starlette itself notices a client that leaves: it cancels the body.
        outputs = client.outputs(rids, queue, first, None, deadline, prompt_of)
        return StreamingResponse(self.events(plan, rids, outputs, asked), media_type="text/event-stream")

    async def events(
        self, plan: AnswerPlan, rids: list[str], outputs: AsyncIterator[OutputPiece], asked: bool
    ) -> AsyncIterator[str]:
        """A streamed answer's SSE lines, in OpenAI's chunks for ``plan.kind`` ("chat" or "completion"),
        the pieces of its choices (engine requests ``rids``) in the order they come; ``asked``: the
        request wants log-probabilities, each chunk carries its tokens' entries. A chat with tools
        reads each choice's text for calls with a parser of its own (its chunks carry content and
        tool_calls)."""
        rid, kind, model, created = plan.id, plan.kind, plan.model, int(time.time())
        reader = plan.tool_reader
        parsers = {choice: reader() for choice in rids} if reader is not None else None
        # stream_chunks builds a piece's chunks before it reads the next piece, so the piece read
        # last says which choice the next chunk is, and which log-probability entries it carries
        # (a piece with entries but no text, a token whose text is empty, passes them on to that
        # choice's next chunk). The usage chunk is made from the last piece, whose counts are the
        # whole request's (EngineClient.outputs).
        current = {"rid": rids[0]}
        unsent: dict[str, list[LogprobEntry]] = {r: [] for r in rids}
        # Text a choice's tool-call parser holds back (a call not closed yet, whitespace that waits
        # for what follows) would make a chunk with an empty delta: make_chunk marks it, and it is
        # not sent (its log-probability entries wait for the chunk that gives the text out).
        held = {"now": False}

        async def noting(pieces: AsyncIterator[OutputPiece]) -> AsyncIterator[OutputPiece]:
            async for piece in pieces:
                current["rid"] = piece.rid
                unsent[piece.rid].extend(piece.logprobs)
                yield piece

        def make_chunk(text, finish_reason, usage_):
            choice, logprobs = current["rid"], None
            index = rids.index(choice)
            delta = None if text is None else ({"content": text} if text else {})
            if kind == "chat" and parsers is not None and text is not None:
                delta, finish_reason = stream_delta(parsers[choice], text, finish_reason)
                held["now"] = not delta and finish_reason is None
            if asked and text is not None and not held["now"]:
                logprobs, unsent[choice] = unsent[choice], []
            content = delta if kind == "chat" else text
            return stream_chunk(kind, rid, model, created, content, finish_reason, usage_, logprobs, index)

        try:
            if kind == "chat":  # OpenAI's first chunk of each choice names the role
                role = {"role": "assistant", "content": ""}
                for index in range(len(rids)):
                    yield sse(stream_chunk(kind, rid, model, created, role, index=index))
            async for line in stream_chunks(noting(outputs), make_chunk, plan.include_usage):
                if held["now"]:
                    held["now"] = False
                    continue
                yield line
        # Cut short (a worker's error, the server stopping, the time limit): a last event with
        # OpenAI's error body, and the stream still ends properly, so a client knows.
        except InvalidRequest as error:
            yield sse(error.body())
            yield sse("[DONE]")
        except TimeoutError:
            yield sse(self.timed_out().body())
            yield sse("[DONE]")
        except NotImplementedError as error:  # an exercise of this stage not written yet
            yield sse(error_body(f"not written yet -> {error}", "server_error"))
            raise
        finally:
            assert self.client is not None
            self.client.abort(rids)  # a no-op for those no longer in flight (else the client went away)


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
    says why a worker process is gone (None while all live); ``heartbeats``: the workers' (for /health).
    ``app.state.serving`` is its ``OpenAIServing``: the launcher tells requests in flight through it."""
    serving = OpenAIServing(server_args, limits, max_running_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = serving.client = EngineClient(ipc, serving.metrics)
        serving.loop = asyncio.get_running_loop()
        reader = asyncio.create_task(client.reader_loop())
        yield
        reader.cancel()
        serving.body_reader.close()
        if serving.grammar_checker is not None:
            serving.grammar_checker.close()

    app = FastAPI(
        title="build-an-inference-engine, stage 9", lifespan=lifespan, default_response_class=OpenAIJSONResponse
    )
    app.state.serving = serving
    app.add_middleware(
        RequestGuard,
        max_bytes=server_args.max_request_bytes,
        read_timeout=server_args.read_timeout,
        api_key=server_args.api_key,
    )
    app.add_middleware(ConnectionLimit, max_connections=server_args.max_connections)  # before the guard reads
    install_error_handlers(app)
    if serving.metrics is not None:  # added last, so outermost: it sees the guards' refusals too
        app.add_middleware(HTTPRequestCounter, metrics=serving.metrics, router=app.router)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat_completions(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(request)

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
        return {"object": "list", "data": [model_card(serving.model_names[0])]}

    @app.get("/v1/models/{name:path}")  # the openai client's models.retrieve; a hub id has a "/"
    async def model(name: str):
        return model_card(serving.check_model(name))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health():
        client = serving.client
        assert client is not None
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

    async def ask_workers(message, timeout: float = 60) -> dict:
        """Send a question down the road (tokenizer -> scheduler -> detokenizer) and wait for its answer."""
        client = serving.client
        assert client is not None
        queue = client.open([message.rid])
        client.send(message)
        try:
            answer = await asyncio.wait_for(queue.get(), timeout=timeout)
        except TimeoutError:
            # The question waits in each worker's queue in turn: name the one stuck longest
            # (an idle worker comes round every IDLE_POLL_MS: one that has not for twice that is busy)
            ages = heartbeats.ages() if heartbeats is not None else {}
            stuck = max(ages, key=ages.__getitem__, default=None)
            busy = stuck is not None and ages[stuck] > 2 * IDLE_POLL_MS / 1000
            why = f"; the {stuck} has not come round its loop for {ages[stuck]:.0f} s" if busy else ""
            raise InvalidRequest(
                f"the workers did not answer in {timeout:g} s (the question passes the tokenizer, the scheduler "
                f"and the detokenizer in turn: one is busy with a long step, or stalled){why}; see /health",
                status_code=503,
                type="server_error",
            ) from None
        finally:
            client.queues.pop(message.rid, None)
        if isinstance(answer, ErrorOut):
            raise rejection(answer)
        return answer.state

    if serving.metrics is not None:
        metrics = serving.metrics

        @app.get("/metrics")
        async def prometheus_metrics():
            """Prometheus' text format: this process's request timings and the scheduler's counts."""
            state = await ask_workers(EngineStateReq(new_id("metrics")), timeout=METRICS_TIMEOUT_S)
            return Response(metrics.render(state), media_type=CONTENT_TYPE_LATEST)

    if server_args.enable_debug_endpoints:

        @app.get("/debug/state")
        async def debug_state():
            """The scheduler's counts and invariant checks (taken between two steps), and the pids."""
            answer = await ask_workers(DebugStateReq(new_id("debug")))
            guards = {
                "max_request_bytes": server_args.max_request_bytes,
                "max_prompt_chars": limits.max_prompt_chars,
                "max_in_flight": serving.max_in_flight,
                "request_timeout": server_args.request_timeout,
                "health_timeout": server_args.health_timeout,
                "heartbeat_ages": heartbeats.ages() if heartbeats else None,
            }
            assert serving.client is not None
            timed = len(serving.metrics.timings) if serving.metrics is not None else 0
            return {
                **answer,
                "open_requests": len(serving.client.queues),
                "timed_requests": timed,  # requests the metrics still time (none once all have ended)
                "pids": pids,
                "guards": guards,
            }

        @app.post("/debug/fault")
        async def debug_fault(request: Request):
            """Arm a fault: the next request ``process`` handles raises or stalls (the guards' tests)."""
            fault = await serving.body_reader.read(request, DebugFault)
            if fault.process == "api_server":
                raise RuntimeError(INJECTED)  # this very request is the one that fails
            return await ask_workers(DebugFaultReq(new_id("fault"), fault.process, fault.kind, fault.seconds))

    return app
