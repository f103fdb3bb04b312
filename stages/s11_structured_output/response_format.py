"""The server's side: OpenAI's ``response_format`` and SGLang's ``regex`` become a grammar.

    {"type": "text"}                                    no grammar (OpenAI's default)
    {"type": "json_object"}                             any JSON object (JSON mode)
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    "regex": "..."                                      (an extension field, SGLang's)

Stage 9's server calls ``structured_params`` only when a request asks for one of them (it imports
this module then, and only when it serves this stage's engine). The grammar is checked here, in
the HTTP server's process, by worker processes with a time and a memory limit
(grammar_check.py), so a malformed or hostile schema gets a 400 naming the problem and never
reaches, or stalls, the tokenizer or the scheduler.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from s02_request_and_sampling.sampling_params import SamplingParams
from s09_zmq_serving.protocol import RETRY_AFTER_S, InvalidRequest, in_api_words

from .grammar_check import GrammarCheckBusy, GrammarChecker, GrammarError
from .sampling_params import JSON_OBJECT_SCHEMA, StructuredSamplingParams  # noqa: F401

# The fields OpenAI defines in each kind of response_format (json_schema's own object too): any
# other key is refused, as an unknown top-level field is, so that a typo cannot pass unnoticed
RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def check_response_format_keys(response_format: dict[str, Any] | None) -> None:
    """InvalidRequest naming the first key ``response_format`` (of a known type) should not hold."""
    kind = (response_format or {}).get("type")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMAT_KEYS:  # (a list or a dict cannot be looked up)
        return  # nothing to check, or a type that grammar_fields refuses itself
    refuse_unknown_keys(response_format, RESPONSE_FORMAT_KEYS[kind], "response_format", f"a {kind} response_format")
    spec = response_format.get("json_schema")
    if isinstance(spec, dict):
        refuse_unknown_keys(spec, JSON_SCHEMA_KEYS, "response_format.json_schema", "json_schema")


def refuse_unknown_keys(fields: dict[str, Any], allowed: set[str], where: str, what: str) -> None:
    for key in fields:
        if key not in allowed:
            raise InvalidRequest(
                f"{where}.{key:.80}: not a field of {what} (it takes {sorted(allowed)})", param=f"{where}.{key:.80}"
            )


def grammar_fields(response_format: dict[str, Any] | None, regex: str | None) -> dict[str, Any]:
    """StructuredSamplingParams' grammar fields for a request; InvalidRequest names what is wrong."""
    raise NotImplementedError(
        "Stage 11: OpenAI's response_format and SGLang's regex -> the grammar's fields - see stages/s11_structured_output/README.md#the-server-response_format-and-regex"  # noqa: E501 (one message, the learner's to read whole)
    )


async def structured_params(
    params: SamplingParams, response_format: dict[str, Any] | None, regex: str | None, checker: GrammarChecker
) -> SamplingParams:
    """``params`` with the request's grammar, checked by ``checker`` (off the event loop, in its
    time and memory limits). Raises InvalidRequest: a 400 for a grammar that is malformed, does
    not compile or passes a limit; a 503 (retry) when every check was busy."""
    check_response_format_keys(response_format)
    fields = grammar_fields(response_format, regex)
    if not fields:
        return params
    param = "regex" if "regex" in fields else "response_format"
    try:
        structured = StructuredSamplingParams(**dataclasses.asdict(params), **fields)
    except ValueError as error:
        raise InvalidRequest(in_api_words(str(error)), param=param) from None  # min_tokens, not min_new_tokens
    try:
        await checker.check(structured.grammar_key)
    except GrammarError as error:
        raise InvalidRequest(str(error), param=param) from None
    except GrammarCheckBusy as error:
        raise InvalidRequest(
            str(error), param=param, status_code=503, type="server_error", headers={"Retry-After": str(RETRY_AFTER_S)}
        ) from None
    return structured
