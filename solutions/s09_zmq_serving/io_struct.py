"""The messages the four processes send each other over ZMQ (pickled by ``send_pyobj``).

Every arrow is a PUSH -> PULL pair over an ipc socket; each process binds the one socket it
reads from and connects to the ones it writes to::

    API server ──GenerateReqInput / AbortReq / DebugStateReq──▶ tokenizer worker
    tokenizer  ──TokenizedGenerateReqInput / AbortReq / DebugStateReq──▶ scheduler
    tokenizer  ──ErrorOut (a prompt it cannot tokenize)──▶ API server
    scheduler  ──BatchTokenIDOut / ErrorOut / DebugStateOut──▶ detokenizer
    detokenizer──BatchStrOut / ErrorOut / DebugStateOut──▶ API server

Requests and aborts travel the same road (API -> tokenizer -> scheduler), so an abort can never
overtake the request it cancels; outputs and errors travel API-wards through the detokenizer, so
a request's text pieces arrive in order. Each message names its request by ``rid`` (a string the
API server draws), which is also the engine's request id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from s02_request_and_sampling.req import FinishReason
from s02_request_and_sampling.sampling_params import SamplingParams


# --- API server -> tokenizer worker -> scheduler -------------------------------------------------

@dataclass
class GenerateReqInput:
    """One request as the API server understood it: exactly one of ``messages`` (chat, through
    the chat template), ``text`` (a completion prompt, tokenized as it is) or ``input_ids``."""

    rid: str
    sampling_params: SamplingParams
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    # max_tokens was not given: generate up to the end of the context (the scheduler knows it)
    fill_max_new_tokens: bool = False


@dataclass
class TokenizedGenerateReqInput:
    """The same request with its prompt as token ids, ready for the engine."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    fill_max_new_tokens: bool = False


@dataclass
class AbortReq:
    """Stop this request now and free what it holds (its client went away)."""

    rid: str


@dataclass
class DebugStateReq:
    """Ask the scheduler, between two steps, for its counts and its invariant checks."""

    rid: str


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


@dataclass
class BatchStrOut:
    """The same step as text: ``texts[i]`` is what request ``rids[i]``'s client may see now
    (possibly ""), ``finish_reasons[i]`` is None while it goes on."""

    rids: list[str]
    texts: list[str]
    finish_reasons: list[str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]


@dataclass
class ErrorOut:
    """A request that will never run: why, and the HTTP status its client gets."""

    rid: str
    message: str
    status_code: int = 400
    param: str | None = None


@dataclass
class DebugStateOut:
    rid: str
    state: dict[str, Any] = field(default_factory=dict)
