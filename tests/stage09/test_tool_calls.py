"""Stage 9 (graded): tool calls under tool_choice "auto".

The calls written between <tool_call> tags are read out of the text however it is cut into
pieces (a stream's), the tags' text never leaks into the content, and a block that is no call of
the offered tools stays the model's text. Under "required" each tool's "$ref"s still point into
its own parameters. Through the server: the tools and a conversation's earlier calls and results
reach the prompt (the answer equals the offline engine's on the rendered messages), streamed or
not, and malformed tools or messages are 400s naming the field."""

from __future__ import annotations

import json
import random

import pytest
from openai import OpenAI

from s09_zmq_serving.tool_calls import TOOL_PROMPT, ToolCallParser, ToolChoice
from serving_helpers import greedy, offline_engine, offline_outputs, post, read_sse

NAMES = ["get_weather", "get_time"]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"city": "Paris"}}'

# (text the model wrote, the content, the calls (name, arguments), why) under tool_choice "auto"
AUTO_CASES = [
    ("It is sunny.", "It is sunny.", [], "text without a tag is all content"),
    (
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        "",
        [("get_weather", '{"city": "Oslo", "unit": "celsius"}')],
        "a call's block (its tags and its JSON) is not content",
    ),
    (
        f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
        "Let me look.",
        [("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ("get_time", '{"city": "Paris"}')],
        "text, then two calls: their blocks are not content, nor the whitespace next to them",
    ),
    (
        f"<tool_call>{TIME}</tool_call> Then: done.",
        "Then: done.",
        [("get_time", '{"city": "Paris"}')],
        "text after a call is content again",
    ),
    ("a < b, and <tool is not a tag", "a < b, and <tool is not a tag", [], "a '<' that starts no tag is text"),
    ("ends on half a tag <tool_c", "ends on half a tag <tool_c", [], "a tag's start left at the end is text"),
    (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> and <tool_call>not json</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> and <tool_call>not json</tool_call>',
        [],
        "a block that is no call of the offered tools (a function nobody offered, text that is not JSON) is the "
        "model's text, tags and all",
    ),
    (
        'cut short: <tool_call>{"name": "get_time", "argu',
        'cut short: <tool_call>{"name": "get_time", "argu',
        [],
        "a block never closed (max_tokens) is the model's text",
    ),
    ("  spaced  \n", "  spaced  \n", [], "without a call, whitespace is the model's text too"),
    (
        "<tool_call>" + "[" * 5000 + "</tool_call>",
        "<tool_call>" + "[" * 5000 + "</tool_call>",
        [],
        "a block nested past what Python's JSON reads (its recursion limit) is no call: the model's text, tags and all",
    ),
]


def pieces_of(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "characters":
        return list(text)
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def read(text: str, how: str) -> tuple[str, list[tuple[str | None, str]], str | None]:
    """(content, calls (name, arguments), finish reason) of ``text`` fed in pieces, then finished."""
    parser = ToolCallParser(ToolChoice("auto"), NAMES)
    content, calls, ids = "", [], list[str]()
    for piece in [*pieces_of(text, how), None]:
        got, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content += got
        for delta in deltas:
            assert delta.id is not None and delta.id.startswith("call_") and delta.id not in ids, (
                f"{text!r}: each call's delta carries an id of its own, 'call_...', got {delta.id!r} after {ids}"
            )
            ids.append(delta.id)
            calls.append((delta.name, delta.arguments))
    return content, calls, parser.finish_reason("stop")


@pytest.mark.parametrize("how", ["whole", "characters", "random pieces"])
def test_auto_reads_the_calls_out_of_the_text_in_any_pieces(how):
    for text, content, calls, why in AUTO_CASES:
        got_content, got_calls, finish = read(text, how)
        # fed in pieces, a tag may be cut anywhere: what may still become one must wait for the next piece
        cut = "" if how == "whole" else "; in pieces: a tag cut between two must be held back until it is decided"
        assert got_calls == calls, f"{text!r} fed as {how}: calls {got_calls}, expected {calls} ({why}{cut})"
        assert got_content == content, (
            f"{text!r} fed as {how}: content {got_content!r}, expected {content!r} ({why}{cut})"
        )
        want_finish = "tool_calls" if calls else "stop"
        assert finish == want_finish, f"{text!r}: an answer that ended by itself gives {want_finish!r}, got {finish!r}"


def test_a_tag_is_held_back_only_while_it_may_still_be_one():
    parser = ToolCallParser(ToolChoice("auto"), NAMES)
    steps = [
        ("Hi <tool", "Hi", "'<tool' may start <tool_call>: it waits, and so does the space before it"),
        ("_call>", "", "inside an open block nothing is content"),
        (TIME, "", "the block is not closed yet"),
        ("</tool_call>", "", "the call is made; its tags are not content"),
        (" ok <to", "ok", "the whitespace after a call is not content; 'ok' goes out, ' <to' waits"),
        ("day", " <today", "'<today' is no tag: out it goes, with the space that waited"),
    ]
    for piece, want, why in steps:
        content, deltas = parser.feed(piece)
        assert content == want, f"after feeding {piece!r}: content {content!r}, expected {want!r} ({why})"
        made = [(d.name, d.arguments) for d in deltas]
        assert made == ([("get_time", '{"city": "Paris"}')] if piece == "</tool_call>" else []), (
            f"after feeding {piece!r}: calls {made} ({why})"
        )


# --- through the server ---------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, dict(CALL, id="call_2")]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 5}'},
]
# What the model reads: the tools in the system message, the calls and their results in Hermes' tags
RENDERED = [
    {"role": "system", "content": "Be brief.\n\n" + TOOL_PROMPT.format(tools=json.dumps(WEATHER_TOOL))},
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    },
    {
        "role": "user",
        "content": '<tool_response>\n{"temp": 3}\n</tool_response>\n<tool_response>\n{"temp": 5}\n</tool_response>',
    },
]


def test_tools_and_earlier_calls_reach_the_prompt(tiny_server):
    client = OpenAI(base_url=tiny_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    engine = offline_engine(tiny_server.model, pool_size=2048)
    [expected] = offline_outputs(engine, [RENDERED], greedy(12))
    request = dict(model=tiny_server.model.name, messages=CONVERSATION, tools=[WEATHER_TOOL], max_tokens=12)
    answer = client.chat.completions.create(temperature=0, **request)
    choice = answer.choices[0]
    assert answer.usage.prompt_tokens == expected.prompt_tokens, (
        f"the prompt has {answer.usage.prompt_tokens} tokens; rendered as the tools and the calls should be "
        f"(the tools in the system message, each call and result in its tags: tool_calls.chat_template_input) "
        f"it has {expected.prompt_tokens}"
    )
    assert (choice.message.content, choice.message.tool_calls) == (expected.text, None), (
        f"the answer {choice.message.content!r} (calls {choice.message.tool_calls}) should be the offline "
        f"engine's {expected.text!r}, no call in it"
    )
    streamed = client.chat.completions.create(temperature=0, stream=True, **request)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == expected.text, f"streamed, the content is {text!r}; not streamed it was {expected.text!r}"


def test_a_stream_of_tool_chunks_is_well_formed(tiny_server):
    chunks = read_sse(
        post(
            tiny_server,
            "/v1/chat/completions",
            {
                "model": tiny_server.model.name,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [WEATHER_TOOL],
                "tool_choice": "auto",
                "max_tokens": 8,
                "n": 2,
                "seed": 3,
                "stream": True,
                "logprobs": True,
                "stream_options": {"include_usage": True},
            },
            stream=True,
        )
    )
    entries = sum(len((c["choices"][0]["logprobs"] or {}).get("content") or []) for c in chunks if c["choices"])
    assert entries == chunks[-1]["usage"]["completion_tokens"], (
        f"the stream carries {entries} log-probability entries for {chunks[-1]['usage']['completion_tokens']} "
        "tokens: text the tool-call parser holds back passes its entries on to the chunk that sends it"
    )
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks if c["choices"]}
    assert sorted(finishes) == [0, 1] and all(finishes.values()), f"each of 2 choices ends with a reason: {finishes}"
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert set(choice["delta"]) <= {"role", "content", "tool_calls"}, f"a delta holds only those: {choice}"
            assert choice["delta"] or choice["finish_reason"], f"a chunk with nothing in it: {chunk}"


BAD = {"type": "function", "function": {"name": "f"}}
DEEP = json.loads('{"a":' * 70 + "1" + "}" * 70)  # 70 objects, one in another


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name", "pattern"),
        ({"tools": [BAD, BAD]}, "tools.1.function.name", "twice"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({"tools": [BAD], "tool_choice": "always"}, "tool_choice", '"auto"'),
        ({"tools": [BAD], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools", "128"),
        ({"tools": [BAD], "response_format": {"type": "json_object"}}, "response_format", "cannot both"),
        ({"tools": [BAD], "tool_choice": "required"}, "tool_choice", "stage 11"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
            "tools.0.function.parameters",
            "nested 70 levels",
        ),
        (  # response_format's schema: the same limit as the tools', checked before any engine's
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": [DEEP]}}}},
            "response_format.json_schema.schema",
            "nested 72 levels deep; at most 64",
        ),
        (  # OpenAI's rule: a call's arguments are an object (else "required" would read no call at all)
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
            '"type": "object", and its type is "string"',
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
            "it has no type",
        ),
        ({"messages": [{"role": "tool", "content": "3"}]}, "messages.0.tool_call_id", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, "messages.1.content", "required"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}, "messages.0.tool_calls", "assistant"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(tiny_server, fields, param, words):
    body = {"model": tiny_server.model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = post(tiny_server, "/v1/chat/completions", {**body, **fields})
    error = response.json().get("error", {})
    assert response.status_code == 400, f"{fields}: expected a 400, got {response.status_code} {response.text[:300]}"
    assert error.get("param") == param and words in error.get("message", ""), (
        f"{fields}: the error should name {param!r} and say {words!r}; it was {error}"
    )
