"""Tool calls (OpenAI's function calling): instead of an answer, the model asks the client to run
a function, and the client sends the result back in the next request.

    tools        the functions on offer: {"type": "function", "function": {"name", "description",
                 "parameters": a JSON schema of the arguments}}
    tool_choice  "none": answer in text | "auto" (the default with tools): the model decides |
                 "required": at least one call | {"type": "function", "function": {"name": ...}}:
                 exactly that call

A call is text the model writes; the server's part is three things.

1. The model must know the tools. A chat template that knows them (one that reads ``tools``)
   writes them itself, and an earlier call in the history too. SmolLM2's template does not, so
   ``chat_template_input`` writes them into the system message in the Hermes convention (the
   one Qwen2.5's and Hermes' templates use): the tools' JSON between <tools> tags, each call as
   {"name": ..., "arguments": {...}} between <tool_call> tags, a result between <tool_response>
   tags in a user turn.
2. "required" and a named function must produce a call, whatever the model would rather write:
   that is structured output (stage 11). ``tool_call_schema`` is the JSON schema the answer is
   held to: the named function's parameters (the answer is the arguments), or an array of
   {"name", "arguments"} objects, each one of the tools'.
3. The calls are read out of the text, also while it streams (``ToolCallParser``): the arguments
   of a named call as they come, each call of an array when its object closes, and under "auto"
   each <tool_call> block when it closes; text around the blocks stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from .protocol import ChatCompletionRequest, Choice, InvalidRequest

MAX_TOOLS = 128  # OpenAI's limit
# A schema nested deeper than this is refused: deeper ones outgrow the grammar library's limits (it
# gives up near 60 levels), and the processes' pickling of a request (Python's recursion limit)
MAX_SCHEMA_DEPTH = 64
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes convention's tags around a call

TOOL_PROMPT = """# Tools

You may call functions to help with the request. Their signatures are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and its arguments inside <tool_call></tool_call>:
<tool_call>
{{"name": <the function's name>, "arguments": <its arguments, a JSON object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tool_choice asks: mode "none", "auto", "required" or "named" (``name``)."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: "required" may make several calls


def resolve_tool_choice(request: ChatCompletionRequest) -> ToolChoice:
    """The request's ToolChoice; InvalidRequest names what is wrong (duplicate names, parameters
    that are no object's schema, a schema nested too deep (response_format's too), a choice
    without tools or naming none of them, a grammar of its own besides a constrained choice)."""
    tools = request.tools or []
    choice = request.tool_choice
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools may hold at most {MAX_TOOLS} functions, got {len(tools)}", param="tools")
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(
                f"tools[{i}].function.name: {name!r} is given twice; each function needs a name of its own",
                param=f"tools.{i}.function.name",
            )
    for i, tool in enumerate(tools):
        parameters = tool.function.parameters
        refuse_deep_schema(parameters, f"tools[{i}].function.parameters", f"tools.{i}.function.parameters")
        # A call's arguments are a JSON object (OpenAI refuses other parameters too): under "required" a
        # string's "arguments" would be no call, and the answer would hold nothing
        if parameters and parameters.get("type") != "object":
            has = f"its type is {json.dumps(parameters['type'])[:64]}" if "type" in parameters else "it has no type"
            raise InvalidRequest(
                f'tools[{i}].function.parameters must be a JSON schema with "type": "object", and {has}; a '
                "function without arguments leaves parameters out (or sends {})",
                param=f"tools.{i}.function.parameters",
            )
    spec = (request.response_format or {}).get("json_schema")
    if isinstance(spec, dict):  # the other schema a request sends: the same limit
        where = "response_format.json_schema.schema"
        refuse_deep_schema(spec.get("schema"), where, where)
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice is only allowed when tools are given", param="tool_choice")
        return ToolChoice("none")
    parallel = request.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        mode = choice or "auto"
        tool_choice = ToolChoice(mode, parallel=parallel)
    else:
        if choice.function.name not in names:
            raise InvalidRequest(
                f"tool_choice names the function {choice.function.name[:64]!r}, which is not among the tools "
                f"({', '.join(names)[:500]})",
                param="tool_choice",
            )
        tool_choice = ToolChoice("named", choice.function.name, parallel)
    if tool_choice.mode != "none" and (request.response_format not in (None, {"type": "text"}) or request.regex):
        raise InvalidRequest(
            "response_format (or regex) and tools cannot both shape one answer; send tool_choice 'none' or "
            "leave the format out",
            param="response_format" if request.response_format else "regex",
        )
    return tool_choice


def refuse_deep_schema(schema: Any, where: str, param: str) -> None:
    """InvalidRequest if ``schema`` (found at ``where`` in the request) nests deeper than MAX_SCHEMA_DEPTH."""
    depth = nesting_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(
            f"{where} is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed", param=param
        )


def nesting_depth(value: Any) -> int:
    """How many objects and arrays deep a JSON value goes (counted without recursing, as any depth parses)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments: its parameters schema (none, or {}: an empty object, as OpenAI)."""
    parameters = tool["function"].get("parameters")
    return parameters if parameters else {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_schema(tools: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any] | None:
    """The JSON schema a constrained choice holds the answer to; None under "none" and "auto"."""
    if choice.mode == "named":
        (tool,) = [t for t in tools if t["function"]["name"] == choice.name]
        return arguments_schema(tool)
    if choice.mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                # where the parameters now sit: their "$ref"s to their own parts ("#/$defs/...") must say so
                "arguments": moved_refs(arguments_schema(tool), f"#/items/anyOf/{i}/properties/arguments"),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, tool in enumerate(tools)
    ]
    return {"type": "array", "minItems": 1, **({} if choice.parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


DATA_KEYWORDS = {"const", "enum", "default", "examples"}  # their values are JSON data: a "$ref" there is no reference
NAMED_SCHEMAS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}  # name -> schema


def moved_refs(schema: Any, at: str) -> Any:
    """A copy of ``schema`` for its new place ``at`` (a JSON pointer) in a larger schema: each "$ref"
    to a part of it ("#", "#/...") is prefixed with ``at``, so that it points where the client meant.
    (Recursive: the schema passed resolve_tool_choice's depth limit.)"""
    if isinstance(schema, list):
        return [moved_refs(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved[key] = at + value[1:]
        elif key in DATA_KEYWORDS:
            moved[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):  # a property may be named "enum"
            moved[key] = {name: moved_refs(item, at) for name, item in value.items()}
        else:
            moved[key] = moved_refs(value, at)
    return moved


# --- the prompt -----------------------------------------------------------------------------------


def chat_template_input(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_knows_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The (messages, tools) to render with the chat template. A template that knows tools gets
    them as they are (a call's arguments as a dict, as transformers' templates want them); for
    any other, the tools are written into the system message and the calls and results in the
    history into the turns' text (the Hermes convention), and the template gets plain messages."""
    if template_knows_tools:
        return [
            dict(m, tool_calls=[as_template_call(c) for c in m["tool_calls"]]) if "tool_calls" in m else m
            for m in messages
        ], tools
    plain: list[dict[str, Any]] = []
    results_turn = False  # the last turn holds tool results: the results of one turn's calls share it
    for message in messages:
        if message["role"] == "tool":
            result = f"<tool_response>\n{message['content']}\n</tool_response>"
            if results_turn:
                plain[-1]["content"] += "\n" + result
            else:
                plain.append({"role": "user", "content": result})
            results_turn = True
            continue
        results_turn = False
        calls = [hermes_call(c) for c in message.get("tool_calls", ())]
        text = "\n".join(([message["content"]] if message["content"] else []) + calls)
        plain.append({k: v for k, v in message.items() if k != "tool_calls"} | {"content": text})
    if tools:
        listed = TOOL_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if plain[0]["role"] == "system":
            plain[0] = dict(plain[0], content=f"{plain[0]['content']}\n\n{listed}")
        else:
            plain.insert(0, {"role": "system", "content": listed})
    return plain, None


def as_template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call with its arguments as a JSON value (their text, if it is not JSON or
    nests deeper than a schema may)."""
    text = call["function"]["arguments"]
    try:
        arguments = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        arguments = text
    if nesting_depth(arguments) > MAX_SCHEMA_DEPTH:
        arguments = text
    return {"type": "function", "function": {"name": call["function"]["name"], "arguments": arguments}}


def hermes_call(call: dict[str, Any]) -> str:
    """A call in the Hermes convention, its arguments' text as the model wrote it."""
    function = call["function"]
    return f'{OPEN}\n{{"name": {json.dumps(function["name"])}, "arguments": {function["arguments"]}}}\n{CLOSE}'


# --- the answer -----------------------------------------------------------------------------------


@dataclass
class ToolCallDelta:
    """A piece of call number ``index``: its first piece carries the call's id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def shown(self) -> dict[str, Any]:
        """OpenAI's shape of it in a stream's delta (the first piece also says its type)."""
        head = {"id": self.id, "type": "function"} if self.id is not None else {}
        function = {"name": self.name} if self.name is not None else {}
        return {"index": self.index, **head, "function": {**function, "arguments": self.arguments}}

    def whole(self) -> dict[str, Any]:
        """OpenAI's shape of a whole call (this delta being one)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call(index: int, name: str, arguments: str) -> ToolCallDelta:
    return ToolCallDelta(index, arguments, f"call_{uuid.uuid4().hex[:24]}", name)


@dataclass
class ToolCallParser:
    """One choice's text, read as it comes: ``feed(text)`` and, at the end, ``finish()`` each
    return (content, [ToolCallDelta]); the same text fed in any pieces gives the same result.

    named      the text is the arguments: each piece is a piece of call 0's arguments
    required   the text is a JSON array of {"name", "arguments"} objects: a call when its object closes
    auto       content, with <tool_call> blocks: a call when its block closes (and holds a JSON
               {"name", "arguments"} of one of the tools; else the block stays content, as written).
               Whitespace next to a call is not content: trailing whitespace waits to see what
               follows, and so does a tail that may be the start of a tag."""

    choice: ToolChoice
    tool_names: list[str]
    calls: list[ToolCallDelta] = field(default_factory=list)  # the calls so far (a named one: its first piece)
    buffer: str = ""  # text read but not yet given out (required: the object being read)
    in_call: bool = False  # auto: inside a <tool_call> block
    whitespace: str = ""  # auto: content's trailing whitespace, given out only if content follows
    after_call: bool = False  # auto: nothing but whitespace since the last call
    depth: int = 0  # required: how deep in the JSON array, outside strings
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.choice.mode == "named":
            if self.calls:
                return "", [ToolCallDelta(0, text)] if text else []
            self.calls.append(new_call(0, self.choice.name or "", text))
            return "", [self.calls[0]]
        if self.choice.mode == "required":
            return "", self.read_array(text)
        return self.read_blocks(text)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.choice.mode == "named":
            return self.feed("") if not self.calls else ("", [])
        if self.choice.mode == "required":
            return "", []  # an object cut short (max_tokens) is no call
        rest, self.buffer = (OPEN if self.in_call else "") + self.buffer, ""  # a block never closed is text
        content = self.content(rest)
        return content + ("" if self.calls else self.whitespace), []

    def finish_reason(self, reason: str | None) -> str | None:
        """A choice that ended by itself after making calls ended to have them run."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def read_array(self, text: str) -> list[ToolCallDelta]:
        """Each object of the array (depth 2 and deeper) collects in ``buffer`` until it closes."""
        done = []
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch == "{" and not self.in_string):
                self.buffer += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.buffer:
                    call, self.buffer = self.read_call(self.buffer), ""
                    done += [call] if call is not None else []
        return done

    def read_blocks(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """auto: the content and the calls that ``text`` completes. ``buffer`` keeps what cannot be
        decided yet (an open block, or a tail that may be the start of <tool_call>); ``content``
        gives out a piece of content, ``read_call`` makes a block's call (None: it holds none)."""
        # BEGIN EXERCISE: read <tool_call> blocks out of streamed text [#reading-tool-calls]
        content, done = "", list[ToolCallDelta]()
        self.buffer += text
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return content, done
                body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(CLOSE) :], False
                call = self.read_call(body)
                if call is None:
                    content += self.content(OPEN + body + CLOSE)  # not a call of one of the tools
                else:
                    done.append(call)
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                content += self.content(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(OPEN) :], True
                continue
            held = next((n for n in range(len(OPEN) - 1, 0, -1) if self.buffer.endswith(OPEN[:n])), 0)
            cut = len(self.buffer) - held
            content += self.content(self.buffer[:cut])
            self.buffer = self.buffer[cut:]
            return content, done
        # END EXERCISE

    def content(self, text: str) -> str:
        """What of ``text`` (content between calls) is given out now."""
        if self.after_call:
            text = text.lstrip()
        if not text.strip():
            self.whitespace += text
            return ""
        kept = text.rstrip()
        out, self.whitespace, self.after_call = self.whitespace + kept, text[len(kept) :], False
        return out

    def read_call(self, body: str) -> ToolCallDelta | None:
        """The call a block or an array's object holds, if it is one of the tools' (then counted in ``calls``)."""
        try:
            call = json.loads(body)
        except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past Python's recursion limit
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tool_names:
            return None
        if not isinstance(call.get("arguments"), dict):
            return None
        self.calls.append(new_call(len(self.calls), call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        self.whitespace, self.after_call = "", True  # the whitespace before the call is not content, nor after it
        return self.calls[-1]


def read_whole(choice: Choice, parser: ToolCallParser) -> Choice:
    """A whole answer's choice with its calls read out of its text, by the parser a stream uses."""
    content, _ = parser.feed(choice.text)
    rest, _ = parser.finish()
    choice.text, choice.finish_reason = content + rest, parser.finish_reason(choice.finish_reason)
    choice.tool_calls = [call.whole() for call in parser.calls] or None
    return choice


def stream_delta(parser: ToolCallParser, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A stream chunk's delta for the next ``text`` of a choice (and, with a finish reason, its
    end: what the parser held back), and the chunk's finish reason."""
    content, calls = parser.feed(text)
    if finish_reason is not None:
        rest, more = parser.finish()
        content, calls, finish_reason = content + rest, calls + more, parser.finish_reason(finish_reason)
    delta: dict[str, Any] = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [call.shown() for call in calls]
    return delta, finish_reason
