"""The messages the four processes send each other over ZMQ (pickled by ``send_pyobj``).

Every arrow is a PUSH -> PULL pair over an ipc socket; each process binds the one socket it
reads from and connects to the ones it writes to::

    API server ──GenerateReqInput / AbortReq / EngineStateReq / DebugStateReq / DebugFaultReq──▶ tokenizer
    tokenizer  ──TokenizedGenerateReqInput / AbortReq / EngineStateReq / DebugStateReq / DebugFaultReq──▶ scheduler
    tokenizer  ──ErrorOut (a prompt it cannot tokenize, or a fault)──▶ API server
    scheduler  ──BatchTokenIDOut / ErrorOut / EngineStateOut / DebugStateOut / DebugFaultReq──▶ detokenizer
    detokenizer──BatchStrOut / ErrorOut / EngineStateOut / DebugStateOut──▶ API server

Requests and aborts travel the same road (API -> tokenizer -> scheduler), so an abort can never
overtake the request it cancels; outputs and errors travel API-wards through the detokenizer, so
a request's text pieces arrive in order. Each message names its request by ``rid`` (a string the
API server draws), which is also the engine's request id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from s02_request_and_sampling.logprobs import TokenLogprob
from s02_request_and_sampling.req import FinishReason
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.servable import RequestTooLong

# --- API server -> tokenizer worker -> scheduler -------------------------------------------------


@dataclass
class GenerateReqInput:
    """One request as the API server understood it: exactly one of ``messages`` (chat, through
    the chat template), ``text`` (a completion prompt, tokenized as it is) or ``input_ids``."""

    rid: str
    sampling_params: SamplingParams
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # chat: the functions the model may call (tool_calls.py)
    text: str | None = None
    input_ids: list[int] | None = None
    # max_tokens was not given: generate up to the end of the context (the scheduler knows it)
    fill_max_new_tokens: bool = False
    echo: bool = False  # a completion's echo: its answer starts with its prompt (PromptEcho)


@dataclass
class TokenizedGenerateReqInput:
    """The same request with its prompt as token ids, ready for the engine."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    fill_max_new_tokens: bool = False
    echo: bool = False


@dataclass
class AbortReq:
    """Stop this request now and free what it holds (its client went away)."""

    rid: str


@dataclass
class EngineStateReq:
    """Ask the scheduler, between two steps, for the numbers /metrics shows (metrics.py)."""

    rid: str


@dataclass
class DebugStateReq:
    """Ask the scheduler, between two steps, for its counts and its invariant checks."""

    rid: str


@dataclass
class DebugFaultReq:
    """Arm a fault in one process, for the tests of the guards (only with --enable-debug-endpoints):
    the next request that ``process`` handles raises (``kind`` "raise") or waits ``seconds``
    ("stall"); in the scheduler, the next forward pass does. It travels the whole road
    (tokenizer -> scheduler -> detokenizer), each process arming it if it is the one named, and
    the detokenizer answers ``DebugStateOut``: once the answer is back, every process is armed."""

    rid: str
    process: str  # "tokenizer", "scheduler" or "detokenizer"
    kind: str  # "raise" or "stall"
    seconds: float = 0.0


# --- scheduler -> detokenizer -> API server ------------------------------------------------------


@dataclass
class BatchTokenIDOut:
    """What one engine step produced: entry i is request ``rids[i]``'s new tokens. A finished
    request's last entry has its finish reason ("stop", "length" or "abort")."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]  # every generated token so far, a matched stop token / EOS included
    stops: list[list[str]]  # each request's stop strings: the detokenizer trims and holds back by them
    new_logprobs: list[list[TokenLogprob]]  # one per new token for a request that asked, else []
    # rid -> its prompt, with the first output of a request that asked for echo
    echoes: dict[str, PromptEcho] = field(default_factory=dict)


@dataclass
class PromptEcho:
    """A completion's prompt as the model read it (``echo``): its ids and, when the request asked
    for log-probabilities too, each prompt token's TokenLogprob after the first (stage 2's
    prompt_logprobs, complete by the request's first token)."""

    input_ids: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass
class BatchStrOut:
    """The same step as text: ``texts[i]`` is what request ``rids[i]``'s client may see now
    (possibly ""), ``finish_reasons[i]`` is None while it goes on."""

    rids: list[str]
    texts: list[str]
    finish_reasons: list[str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[list[LogprobEntry]]  # the tokens whose text went out in texts[i] (for a request that asked)


@dataclass
class LogprobEntry:
    """One token's log-probability as a client reads it: the token's own text and exact bytes
    (part of a UTF-8 character shows as U+FFFD in ``token``; the bytes stay exact), where its text
    starts in the answer, and the likeliest tokens at its place as (text, bytes, logprob). An
    echoed prompt's first token has neither logprob nor alternatives (None: nothing precedes it)."""

    token: str
    token_bytes: bytes
    logprob: float | None
    text_offset: int
    top: list[tuple[str, bytes, float]] | None


@dataclass
class ErrorOut:
    """A request that ends in an error: why, and the HTTP status its client gets (400: its input
    cannot be served; 500: a fault of the server while handling it; 503: the server is stopping)."""

    rid: str
    message: str
    status_code: int = 400
    param: str | None = None
    code: str | None = None  # OpenAI's error code, e.g. "context_length_exceeded"

    @classmethod
    def refused(cls, rid: str, error: ValueError) -> "ErrorOut":
        """A request the engine can never serve (its add_request raised ValueError): a 400 with the
        engine's reason. One too long for the engine is told in the API's words (``max_tokens``,
        not the engine's max_new_tokens), with the part to shorten and OpenAI's code for it."""
        if isinstance(error, RequestTooLong):
            param = "max_tokens" if error.field == "max_new_tokens" else "prompt"
            return cls(rid, error.describe("max_tokens"), 400, param=param, code="context_length_exceeded")
        return cls(rid, str(error), 400)

    @classmethod
    def internal(cls, rid: str, error: BaseException, what: str = "internal error") -> "ErrorOut":
        """A fault of the server (not of the request's input): a 500 that names the exception."""
        return cls(rid, f"{what}: {describe_error(error)}", 500)


def describe_error(error: BaseException) -> str:
    """One line for an exception; an exercise of the skeleton says so ("not written yet")."""
    if isinstance(error, NotImplementedError) and str(error).startswith("Stage "):
        return f"not written yet -> {error}"
    return f"{type(error).__name__}: {error}"


@dataclass
class DebugStateOut:
    rid: str
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineStateOut:
    """The scheduler's answer to EngineStateReq: its counts, as ``SchedulerProcess.engine_state``."""

    rid: str
    state: dict[str, Any]
