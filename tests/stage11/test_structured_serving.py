"""Stage 11 (graded): the server speaks OpenAI's ``response_format`` and SGLang's ``regex``.

The official ``openai`` client's ``parse`` helper gets an instance of its pydantic model back;
``json_schema`` and ``regex`` requests, streamed and not, answer text that validates and matches;
each answer equals the offline engine's; a schema or regex that does not compile, or a request
that mixes them, is a 400 that names the problem, and the server serves on; a grammar refused
once is refused at once when sent again. Forced tool calls ("required", a named function) follow
the tools' schemas."""

from __future__ import annotations

import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "stage09"))

from s09_zmq_serving.protocol import InvalidRequest  # noqa: E402
from s11_structured_output.response_format import grammar_fields  # noqa: E402
from s11_structured_output.sampling_params import canonical_schema  # noqa: E402
from serving_helpers import Server, post, read_sse  # noqa: E402
from structured_helpers import REGEXES, SCHEMAS, constrained, engine_on  # noqa: E402


class Pet(BaseModel):
    name: str = Field(max_length=4)
    age: int = Field(ge=0, le=20)
    kind: Literal["cat", "dog"]


@pytest.fixture(scope="module")
def server(tiny_models_root, tmp_path_factory):
    grammar_fields({"type": "json_object"}, None)  # an unwritten stage fails here, before the server starts
    server = Server(
        tiny_models_root / "llama",
        ["--pool-size", "2048", "--max-running-requests", "16"],
        tmp_path_factory.mktemp("s11-server"),
    )
    yield server
    server.stop()


def deep_list(levels: int) -> list:
    """[[...]]: ``levels`` arrays, one in another."""
    return json.loads("[" * levels + "]" * levels)


DEEP_ARRAYS = re.compile(r'"<(\d+) arrays deep>"')


def deep_arrays(levels: int) -> str:
    """A stand-in for ``deep_list(levels)`` that ``as_json`` writes out: json's reader and writer
    recurse per level, and in a pytest-xdist worker, whose stack starts deeper, a body this deep
    built in Python passes the recursion limit (the module did not even collect)."""
    return f"<{levels} arrays deep>"


def as_json(body: dict) -> str:
    """``body`` as JSON, each ``deep_arrays`` stand-in written out."""
    return DEEP_ARRAYS.sub(lambda found: "[" * int(found[1]) + "]" * int(found[1]), json.dumps(body))


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_response_format_and_regex_map_to_the_grammar_fields():
    # first in the file: a wrong mapping is named here, before the served tests show its symptoms
    schema = SCHEMAS["flat"]
    cases = [
        ((None, None), {}, "no grammar"),
        (({"type": "text"}, None), {}, "text is no constraint"),
        (({"type": "json_object"}, None), {"json_schema": '{"type":"object"}'}, "any JSON object"),
        (
            ({"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}, None),
            {"json_schema": schema},
            "the schema INSIDE json_schema, not its wrapper {name, schema, strict}",
        ),
        ((None, "[a-z]+"), {"regex": "[a-z]+"}, "SGLang's regex field as it is"),
        (({"type": "text"}, "[a-z]+"), {"regex": "[a-z]+"}, "text is no constraint, so a regex goes with it"),
    ]
    for (response_format, regex), want, why in cases:
        try:
            got = grammar_fields(response_format, regex)
        except InvalidRequest as error:
            pytest.fail(
                f"response_format={response_format}, regex={regex!r}: refused ({error}), expected {want} ({why})"
            )
        # a schema as a dict or as its JSON text: StructuredSamplingParams reads either the same way
        spelled = [{k: canonical_schema(v) if k == "json_schema" else v for k, v in d.items()} for d in (got, want)]
        assert spelled[0] == spelled[1], (
            f"response_format={response_format}, regex={regex!r}: fields {got}, expected {want} ({why})"
        )


def test_the_openai_parse_helper_gets_its_pydantic_model(server):
    completion = client(server).beta.chat.completions.parse(
        model="llama",
        messages=[{"role": "user", "content": "A pet, please."}],
        response_format=Pet,
        temperature=0,
        max_tokens=80,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Pet), (
        f"the openai client's parse helper should get a Pet back; the answer was {message.content!r} "
        f"(finish reason {completion.choices[0].finish_reason})"
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_json_schema_and_regex_answers_follow_their_grammar(server, tiny_models_root, stream):
    schema = SCHEMAS["nested"]
    chat = {
        "model": "llama",
        "messages": [{"role": "user", "content": "Who?"}],
        "temperature": 0,
        "max_tokens": 80,
        "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "who", "schema": schema}},
    }
    completion = {"model": "llama", "prompt": "Code:", "temperature": 0, "max_tokens": 40, "stream": stream}
    completion["regex"] = REGEXES[1]
    texts = []
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        response = post(server, path, body, stream=stream)
        assert response.status_code == 200, f"{path} {body}: {response.status_code} {response.text[:300]}"
        if stream:
            chunks = read_sse(response)
            key = "delta" if "chat" in path else None
            texts.append(
                "".join(
                    (c["delta"].get("content") or "") if key else c["text"]
                    for chunk in chunks
                    for c in chunk["choices"]
                )
            )
        else:
            choice = response.json()["choices"][0]
            texts.append(choice["message"]["content"] if "chat" in path else choice["text"])
    jsonschema.validate(json.loads(texts[0]), schema)
    assert re.fullmatch(REGEXES[1], texts[1]), f"the regex answer {texts[1]!r} does not match {REGEXES[1]!r}"
    # the same requests offline: the server adds nothing and loses nothing
    engine = engine_on(tiny_models_root / "llama", pool_size=512)
    offline = engine.generate(
        [[{"role": "user", "content": "Who?"}], engine.tokenizer.encode("Code:")],  # completions: no chat template
        [constrained("json", schema, max_new_tokens=80), constrained("regex", REGEXES[1], max_new_tokens=40)],
    )
    assert [out.text for out in offline] == texts, f"served {texts}, offline {[out.text for out in offline]}"


# an unknown response_format type is refused with the types that are: each named, in any words
SUPPORTED_TYPES = ("text", "json_object", "json_schema")


@pytest.mark.parametrize(
    "body,param,words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "response_format",
            "bogus",
        ),
        ({"regex": "[0-9"}, "regex", "unclosed"),
        ({"regex": "a", "response_format": {"type": "json_object"}}, "regex", "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format", SUPPORTED_TYPES),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict", "not a field"),
        ({"response_format": {"type": "text", "foo": 1}}, "response_format.foo", "not a field"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "scheme": {}}}},
            "response_format.json_schema.scheme",
            "not a field",
        ),
        ({"regex": "a+", "min_tokens": 3}, "regex", "min_tokens.*grammar"),
        (  # the body parser reads NaN; the message names where it is in the schema the client sent
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"maximum": float("nan")}}}},
            "response_format",
            "nan at maximum",
        ),
        ({"response_format": {"type": ["json_object"]}}, "response_format", SUPPORTED_TYPES),
        ({"response_format": {"type": {"json": 1}}}, "response_format", SUPPORTED_TYPES),
        (  # deeper than Python's JSON writes (its recursion limit)
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": deep_arrays(950)}}}},
            "response_format.json_schema.schema",
            "nested 951 levels deep; at most 64",
        ),
        (  # deeper than the grammar library reads: refused before, with the same words, not the library's
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": deep_arrays(130)}}}},
            "response_format.json_schema.schema",
            "nested 131 levels deep; at most 64",
        ),
    ],
    ids=[
        "bad-schema",
        "bad-regex",
        "both",
        "unknown-type",
        "no-schema",
        "unknown-key",
        "unknown-key-text",
        "typo",
        "min-tokens",
        "nan",
        "type-list",
        "type-object",
        "deep",
        "deeper-than-the-library",
    ],
)
def test_a_grammar_that_cannot_be_served_is_a_400_naming_it(server, body, param, words):
    """``words``: a pattern the message must match, or a tuple of words it must all hold (in any order)."""
    request = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, **body}
    response = post(server, "/v1/chat/completions", data=as_json(request))
    error = response.json().get("error", {}) if response.status_code == 400 else {}
    patterns = [rf"\b{re.escape(word)}\b" for word in words] if isinstance(words, tuple) else [words]
    wanted = f"all of {words}" if isinstance(words, tuple) else repr(words)
    assert (
        response.status_code == 400
        and error.get("param") == param
        and all(re.search(pattern, error.get("message", ""), re.IGNORECASE) for pattern in patterns)
    ), f"{body}: expected a 400 on {param!r} matching {wanted}; got {response.status_code} {response.text[:300]}"
    assert server.health().status_code == 200, "the server should serve on after a refused grammar"


NOT_MATCHABLE = [
    # compiles, but matching its first token passes one of llguidance's limits
    ({"regex": "a{1000000}"}, "regex", "simplify it"),
    # compiles, but no character is outside [\x00-\x{10ffff}]: no text matches
    ({"regex": "[^\\x00-\\x{10ffff}]"}, "regex", "matches no text"),
    # a schema that is only a reference to itself: no JSON value ends it
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}},
        "response_format",
        "matches no text",
    ),
]


@pytest.mark.parametrize("fields, param, words", NOT_MATCHABLE, ids=["a{1000000}", "empty class", "self-ref"])
def test_a_grammar_the_library_gives_up_on_is_a_400_with_its_reason(server, fields, param, words):
    """These pass the front end's check (they compile) but fail once matching starts: the
    scheduler ends that request alone, and its client gets a 400 on the grammar's field, with the
    library's reason in words a client can act on (not "NoExtensionBias", not "increase limits.")."""
    request = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    response = post(server, "/v1/chat/completions", {**request, **fields})
    error = response.json().get("error", {}) if response.status_code == 400 else {}
    message = error.get("message", "")
    assert "gave up" in message and words in message and error.get("param") == param, (
        f"{fields}: expected a 400 on {param!r} saying the library gave up, with {words!r}; "
        f"got {response.status_code} {response.text[:300]}"
    )
    assert post(server, "/v1/chat/completions", {**request, "regex": "(yes|no)"}).status_code == 200


def test_an_error_that_quotes_a_huge_grammar_is_cut(server):
    """llguidance quotes a malformed regex several times in its message: 400 KB of "(" once came
    back as a 1.6 MB error. The message is cut, and says how much was left out."""
    regex = "(" * 200_000 + ")" * 200_000
    request = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "regex": regex}
    response = post(server, "/v1/chat/completions", request)
    message = response.json().get("error", {}).get("message", "") if response.status_code == 400 else ""
    assert "invalid regex" in message and message.endswith("more characters cut)"), (
        f"expected a 400 saying the regex is invalid, cut short; got {response.status_code} {response.text[:300]}"
    )
    assert len(response.content) < 10_000, f"the error body is {len(response.content)} bytes for a 400 KB regex"


def test_a_refused_grammar_sent_again_is_refused_without_a_check(server):
    """A grammar is checked in one of two worker processes, for at most 5 s. A refused one is
    remembered: sent again, by several clients at once, it is refused at once with the same
    message, and a good grammar sent meanwhile finds a worker free. (Checked anew each time, a
    schema too slow to check kept both workers busy for 5 s per request, and the good one got 503s.)"""
    slow = {"allOf": [{"type": "string", "pattern": f".*{chr(97 + i)}.*"} for i in range(24)]}  # minutes, GBs
    request = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    refused = {**request, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": slow}}}

    def timed(body: dict) -> tuple[int, str, float]:
        started = time.monotonic()
        response = post(server, "/v1/chat/completions", body)
        return response.status_code, response.json().get("error", {}).get("message", ""), time.monotonic() - started

    status, message, _ = timed(refused)
    # (past 5 s, or past the worker's memory cap first: either way a worker was stopped and replaced)
    assert status == 400 and re.search("took longer than|memory", message), f"the slow schema: {status} {message}"
    with ThreadPoolExecutor(5) as pool:
        again = [pool.submit(timed, refused) for _ in range(4)]
        good = pool.submit(timed, {**request, "regex": "(yes|no)"})
        for future in again:
            assert future.result()[:2] == (400, message) and future.result()[2] < 2.5, (
                f"the slow schema sent again should be refused at once (well under the 5 s a check may take), "
                f"with the same message; got {future.result()}"
            )
        assert good.result()[0] == 200, f"a good grammar sent meanwhile should be served: {good.result()}"


# --- tool calls: "required" and a named function are structured output ---------------------------

CITY = {"enum": ["Oslo", "Paris", "Lima"]}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city over the next days",
            "parameters": {
                "type": "object",
                "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"city": CITY},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMA_OF = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def served_calls(server: Server, tool_choice, stream: bool, **more) -> tuple[list[tuple[str, str]], str, object]:
    """((name, arguments) of each call, finish_reason, content) of a greedy chat with TOOLS (or ``more``'s)."""
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 100,  # (the tiny tokenizer makes the tools' prompt near 900 tokens of its 1024)
        "stream": stream,
        **more,
    }
    response = post(server, "/v1/chat/completions", body, stream=stream)
    assert response.status_code == 200, f"tool_choice {tool_choice}: {response.status_code} {response.text[:300]}"
    if not stream:
        choice = response.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function", f"a call's id and type: {call}"
        named = [(call["function"]["name"], call["function"]["arguments"]) for call in calls]
        return named, choice["finish_reason"], choice["message"]["content"]
    pieces: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in read_sse(response):
        for choice in chunk["choices"]:
            assert choice["delta"] or choice["finish_reason"], (
                f"tool_choice {tool_choice}: a chunk with nothing in it (text the parser holds back is sent with "
                f"the call it belongs to): {chunk}"
            )
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
            for delta in choice["delta"].get("tool_calls") or []:
                if "id" in delta:  # a call's first piece: its id and name
                    assert delta["index"] not in pieces, f"call {delta['index']} named twice in the stream"
                    pieces[delta["index"]] = [delta["function"]["name"], ""]
                pieces[delta["index"]][1] += delta["function"]["arguments"]
    return [(pieces[i][0], pieces[i][1]) for i in sorted(pieces)], finish, content or None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_forced_tool_calls_follow_the_tools_schemas(server, tiny_models_root, stream):
    from s09_zmq_serving.tool_calls import ToolChoice, chat_template_input, tool_call_schema

    cases = [
        ({"type": "function", "function": {"name": "get_time"}}, {}, ToolChoice("named", "get_time")),
        ("required", {"parallel_tool_calls": False}, ToolChoice("required", parallel=False)),
        ("required", {}, ToolChoice("required")),
    ]
    engine = engine_on(tiny_models_root / "llama", pool_size=1024)
    for tool_choice, more, choice in cases:
        what = f"tool_choice {tool_choice} {more} (stream={stream})"
        calls, finish, content = served_calls(server, tool_choice, stream, **more)
        assert calls and finish == "tool_calls" and content is None, (
            f"{what}: the answer should be calls only, ended by the model ('tool_calls'); got calls {calls}, "
            f"finish_reason {finish!r}, content {content!r}"
        )
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])
        if choice.mode == "named" or not choice.parallel:
            assert len(calls) == 1, f"{what}: exactly one call, got {calls}"
        if choice.mode == "named":
            assert calls[0][0] == "get_time", f"{what}: the call must be get_time's, got {calls}"
        # offline, the same prompt held to the same schema gives the same calls
        messages, _ = chat_template_input([{"role": "user", "content": "Weather?"}], TOOLS, False)
        [out] = engine.generate([messages], [constrained("json", tool_call_schema(TOOLS, choice), max_new_tokens=100)])
        answer = json.loads(out.text)
        expected = (
            [("get_time", answer)] if choice.mode == "named" else [(call["name"], call["arguments"]) for call in answer]
        )
        assert [(name, json.loads(arguments)) for name, arguments in calls] == expected, (
            f"{what}: served {calls}; offline, held to tool_call_schema, the model wrote {out.text!r}"
        )


def test_the_openai_client_reads_the_calls(server):
    answer = client(server).chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "Time in Lima?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["city"] in CITY["enum"], (
        f"the openai client should read one get_time call with a city; it read {call}"
    )


# The layout pydantic and the openai client write: parts of the schema in $defs, referred to from "#"
CITY_IN_DEFS = {
    "$defs": {
        "City": {"type": "object", "properties": {"name": CITY}, "required": ["name"], "additionalProperties": False}
    },
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/City"}},
    "required": ["city"],
    "additionalProperties": False,
}


def object_of(a: dict) -> dict:
    """The parameters of a function whose one argument ``a`` follows the schema ``a``."""
    return {"type": "object", "properties": {"a": a}, "required": ["a"], "additionalProperties": False}


NO_ARGUMENTS: dict = {}  # OpenAI's "no arguments", as leaving parameters out is
# Nested as deep as a tool's parameters may be (64: the examples are data, so the arguments are {});
# inside the schema "required" holds the answer to, that is 69 levels, which the grammar library reads
AS_DEEP_AS_ALLOWED = {"type": "object", "additionalProperties": False, "examples": [deep_list(62)]}


@pytest.mark.parametrize(
    "parameters", [CITY_IN_DEFS, NO_ARGUMENTS, AS_DEEP_AS_ALLOWED], ids=["$defs", "no-arguments", "64-levels"]
)
def test_required_serves_each_kind_of_parameters(server, parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    calls, finish, content = served_calls(server, "required", False, tools=[tool], parallel_tool_calls=False)
    assert len(calls) == 1 and calls[0][0] == "f" and finish == "tool_calls" and content is None, (
        f"parameters {json.dumps(parameters)[:200]}: one call of f, ended by the model; got calls {calls}, "
        f"finish_reason {finish!r}, content {content!r}"
    )
    arguments = json.loads(calls[0][1])
    jsonschema.validate(arguments, parameters)  # the $refs resolve as the client meant them
    assert parameters or arguments == {}, f"parameters {{}} mean no arguments, got {arguments}"


@pytest.mark.parametrize(
    "fields, words",
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": object_of({"type": "bogus"})}}]},
            "bogus",
        ),
        # passes the server's check; the library gives up on it in the scheduler, which reports it
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": object_of({"$ref": "#"})}}]},
            "gave up.*simplify",
        ),
        ({"min_tokens": 3}, "min_tokens.*grammar"),
    ],
    ids=["bad-schema", "unmatchable-schema", "min-tokens"],
)
def test_a_forced_call_that_cannot_be_served_is_a_400(server, fields, words):
    body = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "max_tokens": 5}
    response = post(server, "/v1/chat/completions", {**body, "tool_choice": "required", **fields})
    error = response.json().get("error", {})
    assert response.status_code == 400 and error.get("param") == "tool_choice" and re.search(words, error["message"]), (
        f"{fields}: expected a 400 on tool_choice matching {words!r}; got {response.status_code} {error}"
    )
