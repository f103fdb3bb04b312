"""The OpenAI HTTP API as data: request bodies (pydantic models), response bodies, error bodies,
and ``to_sampling_params``, which turns a request into stage 2's ``SamplingParams``.

What a field means, and what this server does with it:

    model                      must be a name /v1/models lists, else 404 model_not_found
    messages / prompt          chat goes through the chat template; a completion prompt is
                               tokenized as it is (a string, or a list of token ids), or a
                               batch of up to 64 of them: choice i * n + j is prompt i's j-th
    max_tokens                 (or max_completion_tokens) >= 1; absent: up to the end of the context
    temperature top_p seed     as OpenAI; top_k min_p ignore_eos are extensions (SGLang's too)
    stop                       a string or a list of strings, trimmed from the text
    stream stream_options      SSE chunks; include_usage adds a last chunk with the counts
    name (of a message)        passed to the chat template; refused if the template drops it
    n                          1..16 choices: n engine requests whose prompt the radix cache
                               computes once; choice i samples with seed + i
    logprobs top_logprobs      chat: logprobs true, top_logprobs 0..20; completions: logprobs 0..5;
                               each output token's log-probability under the model's own
                               distribution (stage 2's logprobs.py), in OpenAI's two shapes
    presence_penalty           -2..2 each, as OpenAI (stage 2's penalties.py); repetition_penalty
    frequency_penalty          (0.01..2, transformers') is an extension (SGLang's and vLLM's too)
    logit_bias                 {"token id": -100..100}: the key a token id of the vocabulary
    min_tokens                 extension (vLLM's and SGLang's): EOS is banned until this many
                               tokens are out (stage 2's min_new_tokens); 0..max_tokens
    echo                       completions: the answer starts with the prompt as the model read
                               it; with logprobs, the prompt's tokens first (stage 2's
                               prompt_logprobs; the first one's null): how a text is scored
    tools tool_choice          chat: function calling (tool_calls.py): the tools go into the
    parallel_tool_calls        prompt, "required" or a named function constrain the answer
                               (stage 11's grammar), the calls come back as message.tool_calls;
                               the history may hold an assistant's tool_calls and "tool" results

A field that would change the result and that this server does not do (suffix, best_of, ...)
is rejected with a 400 naming it, never silently ignored; a field nobody knows is rejected too
(OpenAI does the same), so a typo cannot pass unnoticed.

Each list (and logit_bias) whose items pydantic checks one by one holds a bounded number of them
and stops at the first bad one (``capped``). Every field has explicit bounds (``check_limits``;
the table is in the README): a string must be encodable as UTF-8 (JSON allows a lone surrogate
such as "\\ud800"; a tokenizer does not), an integer that reaches a tensor fits its range (top_k
at most the vocabulary, a seed within 64 bits, max_tokens within the context), a float is finite,
stop strings are few and short, and a prompt that cannot fit the context is refused by its
length, before anyone spends time tokenizing it.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from s02_request_and_sampling.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams

from .io_struct import LogprobEntry

Number = Union[float, int]  # strict mode: a JSON integer is a valid float, a string is not
Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]  # a model's, a user's, a part's type

MAX_STOP_STRINGS = 16  # OpenAI allows 4; a few more for clients that send longer lists
MAX_STOP_CHARS = 256  # each stop string; the detokenizer searches them at every step
# A message costs at least one token of the context (check_limits holds them to it); this bound,
# far past any conversation, only caps what a hostile list costs to read before that check
MAX_MESSAGES = 65536
MAX_CONTENT_PARTS = 1024  # a message's parts, joined into its text (clients send one or a few)
MAX_TOOL_CALLS = 128  # one assistant turn's calls: as many as the tools a request may offer (OpenAI's 128)
# One entry per token at most, and the largest vocabularies (Gemma's) have 262,144 tokens
# (check_limits then holds the keys to this model's own)
MAX_LOGIT_BIAS = 262144
MAX_NAME_CHARS = 64  # a message's name (OpenAI's limit)
MAX_CHOICES = 16  # n: each choice is a request of its own in the engine (OpenAI allows 128)
MAX_PROMPTS = 64  # a completion's batch of prompts: each prompt's n choices are requests of their own
MAX_COMPLETION_LOGPROBS = 5  # the completions API's logprobs (OpenAI's limit; chat's top_logprobs go to 20)
# An error message longer than this is cut: a malformed 400 KB regex once came back as a 1.6 MB
# error, quoted four times by the grammar library
MAX_ERROR_CHARS = 2000
RETRY_AFTER_S = 1  # what an overloaded server asks a client to wait before trying again (a 503's Retry-After)


class InvalidRequest(ValueError):
    """A request this server refuses: the HTTP status, OpenAI's error fields, and headers
    (``Retry-After`` on a 503)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status_code, self.type, self.code = message, param, status_code, type, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    if len(message) > MAX_ERROR_CHARS:  # a library's message may quote a huge input several times over
        message = f"{message[:MAX_ERROR_CHARS]}... ({len(message) - MAX_ERROR_CHARS} more characters cut)"
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# The fields that take several shapes, as a 400 about a wrong one names them (else pydantic's
# error about the first shape it tried, "Input should be a valid string", is all a client sees)
FIELD_SHAPES = {
    "content": 'a string, or a list of parts like {"type": "text", "text": "..."}',
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "tool_choice": '"none", "auto", "required", or {"type": "function", "function": {"name": "..."}}',
}


def capped(most: int | None = None) -> Any:
    """A list (or dict) field of the body: at most ``most`` items, and validation stops at its
    first bad item. pydantic would otherwise report every one: a 4 MB body of two million bad
    items made two million errors, which FastAPI lists on the event loop, 20 s in which no other
    client was answered, /health included."""
    return Field(max_length=most, fail_fast=True)


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1.0 is not an integer; forbid: unknown fields are errors
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def one_unknown_field(cls, data: Any) -> Any:
        """An object with more keys than the model has fields holds unknown ones, each an error of
        its own: 300,000 of them took 2 s to list on the event loop. The first is enough to refuse
        it (the 400 names it), so the others are dropped before validation."""
        if isinstance(data, dict) and len(data) > len(cls.model_fields):
            unknown = next(key for key in data if key not in cls.model_fields)
            data = {key: value for key, value in data.items() if key in cls.model_fields or key == unknown}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(BaseModel):
    # Any part parses (image_url, input_audio, ...), so that chat_messages can say which one this
    # server cannot take, rather than pydantic's "Input should be a valid string" about content
    model_config = ConfigDict(extra="allow", strict=True)
    type: Name
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    """A call an assistant made (an earlier answer's, sent back in the history)."""

    id: Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only in an assistant's message that calls tools
    content: str | Annotated[list[ContentPart], capped(MAX_CONTENT_PARTS)] | None = None
    name: Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)] | None = None
    tool_calls: Annotated[list[ToolCall], capped(MAX_TOOL_CALLS)] | None = None  # an assistant's calls
    tool_call_id: Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)] | None = None  # a tool's result


class FunctionDefinition(_Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for the name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # OpenAI: follow the schema exactly; here a forced call always does


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class _SamplingFields(_Strict):
    """The fields chat and completions share."""

    model: Name
    max_tokens: int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: int | None = None  # extension
    min_p: Number | None = None  # extension
    repetition_penalty: Number | None = None  # extension
    seed: int | None = None
    stop: str | Annotated[list[str], capped(MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    regex: str | None = None  # extension (SGLang's): the output matches it; served by stage 11's engine
    user: Name | None = None  # only recorded by OpenAI: harmless to accept
    n: int | None = None
    logprobs: Any = None  # chat: a bool, completions: an int (requested_logprobs)
    top_logprobs: int | None = None
    # JSON keys are strings: token ids spelled in decimal
    logit_bias: Annotated[dict[str, Number], capped(MAX_LOGIT_BIAS)] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    min_tokens: int | None = None  # extension: SamplingParams.min_new_tokens


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], capped(MAX_MESSAGES)]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    tools: Annotated[list[Tool], capped()] | None = None  # tool_calls.py (which allows 128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[Any]  # a string, token ids, or a batch of them; completion_prompts says what is wrong
    echo: bool = False
    suffix: Name | None = None
    best_of: int | None = None


def check_supported(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Reject the fields that would change the result and that this server does not implement
    (and stream_options without a stream, which OpenAI refuses too)."""
    unsupported: list[tuple[str, object, str]] = [
        (  # OpenAI refuses it too: options of a stream that is not one
            "stream_options",
            request.stream_options is not None and not request.stream,
            "stream_options is only allowed with stream: true",
        ),
    ]
    if isinstance(request, CompletionRequest):
        unsupported += [
            ("suffix", request.suffix is not None, "suffix (insertion) is not supported by this server"),
            (
                "best_of",
                request.best_of not in (None, 1),
                f"best_of must be 1, the default (this server does not sample extra answers to return the best "
                f"of; ask for n of them to see several), got {request.best_of}",
            ),
        ]
    for param, bad, message in unsupported:
        if bad:
            raise InvalidRequest(message, param=param)


# --- bounds ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What this server's model and flags allow (the workers report the first three at start)."""

    context_len: int  # the longest sequence, prompt and generated tokens together
    vocab_size: int  # the model's logits: top_k's ceiling
    prompt_vocab_size: int  # the tokenizer's ids: what a token-id prompt may hold
    max_prompt_chars: int  # a longer prompt text (all messages together) is refused untokenized


def check_limits(request: ChatCompletionRequest | CompletionRequest, limits: Limits) -> None:
    """Refuse (InvalidRequest, naming the field) any value outside its bounds, before any worker
    sees the request: every string encodable as UTF-8, every number in its range, floats finite,
    few and short stop strings, a prompt no longer than could ever fit the context."""
    for path, text in strings(request.model_dump(exclude_none=True)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidRequest(
                f"{path}: a string must be valid Unicode; character {error.start} is a lone surrogate "
                f"(U+{ord(text[error.start]):04X}), which cannot be encoded as UTF-8",
                param=path,
            ) from None
    context = limits.context_len
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, field, None)
        if value is not None and not 1 <= value <= context:
            raise InvalidRequest(f"{field} must be >= 1 and <= {context} (the context), got {value}", param=field)
    if request.top_k is not None and not (request.top_k == -1 or 1 <= request.top_k <= limits.vocab_size):
        raise InvalidRequest(
            f"top_k must be -1 (off) or in [1, {limits.vocab_size}] (the vocabulary), got {request.top_k}",
            param="top_k",
        )
    if request.min_tokens is not None and not 0 <= request.min_tokens <= context:
        raise InvalidRequest(
            f"min_tokens must be >= 0 and <= {context} (the context), got {request.min_tokens}", param="min_tokens"
        )
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}] (choices per request), got {request.n}", param="n")
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be in [0, 2**64 - 1], got {request.seed}", param="seed")
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        check_finite(field, getattr(request, field))
    bad = [token for token in token_bias(request) if token >= limits.vocab_size]
    if bad:
        raise InvalidRequest(
            f"logit_bias keys must be token ids in [0, {limits.vocab_size}) (the vocabulary), got {bad[:5]}",
            param="logit_bias",
        )
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])  # (how many: capped)
    if any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise InvalidRequest(
            f"each stop string may be at most {MAX_STOP_CHARS} characters long, got one of {max(map(len, stops))}",
            param="stop",
        )
    if isinstance(request, ChatCompletionRequest):
        if len(request.messages) > context:
            raise InvalidRequest(
                f"{len(request.messages)} messages cannot fit a context of {context} tokens", param="messages"
            )
        tools = [tool.model_dump() for tool in request.tools or ()]  # (their text: what the prompt will show)
        chars = sum(message_chars(m) for m in request.messages) + sum(len(text) for _, text in strings(tools))
        where = "messages"
    else:
        # each prompt of a batch on its own: each is a request of its own, tokenized on its own
        prompt, where = request.prompt, "prompt"
        prompts = prompt if isinstance(prompt, list) and is_batch(prompt) else [prompt]
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequest(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}", param="prompt")
        chars = max((len(p) for p in prompts if isinstance(p, str)), default=0)
        for one in prompts:
            ids = [p for p in one if isinstance(p, int)] if isinstance(one, list) else []
            if len(ids) > context:
                raise InvalidRequest(
                    f"the prompt has {len(ids)} token ids, more than the context of {context} tokens", param="prompt"
                )
            bad = [t for t in ids if not 0 <= t < limits.prompt_vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt token ids must be in [0, {limits.prompt_vocab_size}), got {bad[:5]}", param="prompt"
                )
    if chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"the prompt has {chars} characters, more than the {limits.max_prompt_chars} this server takes "
            f"(no text that long fits the context of {context} tokens); refused without tokenizing it",
            param=where,
        )


def message_chars(message: ChatMessage) -> int:
    """The characters a message brings to the prompt: its text, and the calls it made."""
    content = message.content
    text = len(content or "") if not isinstance(content, list) else sum(len(p.text or "") for p in content)
    calls = message.tool_calls or ()
    return text + sum(len(call.function.name) + len(call.function.arguments) for call in calls)


def strings(value, path: str = ""):
    """Every (path, string) in a parsed JSON value: its strings and its objects' keys."""
    if isinstance(value, str):
        yield path or "body", value
    elif isinstance(value, dict):
        for key, item in value.items():
            shown = str(key).encode("utf-8", "backslashreplace").decode()  # the path names a bad key printably
            inner = f"{path}.{shown}" if path else shown
            yield from strings(key, inner)
            yield from strings(item, inner)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from strings(item, f"{path}.{i}")


def check_finite(field: str, value) -> None:
    if value is None:
        return
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer too big for a float
        finite = False
    if not finite:
        raise InvalidRequest(f"{field} must be a finite number, got {value!r:.40}", param=field)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template wants them ({"role", "content"} with text content, and
    "name" when the message has one; an assistant's "tool_calls" and a tool result's
    "tool_call_id" as OpenAI's dicts, for tool_calls.chat_template_input)."""
    if not request.messages:
        raise InvalidRequest("messages must hold at least one message", param="messages")
    out = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            if not content:  # as OpenAI: a list of parts holds at least one
                raise InvalidRequest(
                    f"messages[{i}].content is an empty list of parts; send a string, or at least one text part",
                    param=f"messages.{i}.content",
                )
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None or part.model_extra:
                    got = f"a {part.type!r} part" if part.type != "text" else f"a text part with {part.model_dump()}"
                    raise InvalidRequest(
                        f'messages[{i}].content[{j}]: only text parts ({{"type": "text", "text": ...}}) are '
                        f"supported, got {got:.200}",
                        param=f"messages.{i}.content.{j}",
                    )
            content = "".join(part.text or "" for part in content)
        check_tool_fields(message, i)
        role = "system" if message.role == "developer" else message.role  # OpenAI's new name for system
        one: dict[str, Any] = {"role": role, "content": content or ""}
        if message.name is not None:
            one["name"] = message.name
        if message.tool_calls:
            one["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            one["tool_call_id"] = message.tool_call_id
        out.append(one)
    return out


def check_tool_fields(message: ChatMessage, i: int) -> None:
    """What OpenAI requires of the messages of a conversation with tools: only an assistant
    calls them (and may then leave its content out), a tool's result names the call it answers."""
    if message.tool_calls is not None and message.role != "assistant":
        raise InvalidRequest(
            f"messages[{i}].tool_calls: only an assistant's message calls tools, not a {message.role!r} one",
            param=f"messages.{i}.tool_calls",
        )
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise InvalidRequest(
            f"messages[{i}].content is required (only an assistant's message with tool_calls may leave it out)",
            param=f"messages.{i}.content",
        )
    if (message.role == "tool") != (message.tool_call_id is not None):
        raise InvalidRequest(
            f"messages[{i}]: a tool message needs the tool_call_id of the call it answers, and only a tool "
            "message has one",
            param=f"messages.{i}.tool_call_id",
        )


def completion_prompts(request: CompletionRequest) -> list[tuple[str | None, list[int] | None]]:
    """The completion's prompts, each (text, None) or (None, token ids), in OpenAI's four shapes:
    one string, one list of token ids, or a batch of them (a list of strings and lists of ids)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if not is_batch(prompt):
        return [(None, token_ids(prompt, "prompt"))]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
    return [(p, None) if isinstance(p, str) else (None, token_ids(p, f"prompt.{i}")) for i, p in enumerate(prompt)]


def is_batch(prompt: list) -> bool:
    """A list prompt is a batch when it holds strings and lists (else it is one prompt's token ids)."""
    return bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


def token_ids(values: list, where: str) -> list[int]:
    """One prompt's token ids, checked: a non-empty list of integers >= 0 (the vocabulary's bound
    is check_limits')."""
    if not values:
        raise InvalidRequest(f"{where} must not be empty", param="prompt")
    not_ids = [p for p in values if type(p) is not int]  # (a bool is an int to Python, not to JSON)
    if not_ids:
        raise InvalidRequest(f"{where}: token ids must be integers, got {not_ids[0]!r:.40}", param="prompt")
    if any(p < 0 for p in values):
        raise InvalidRequest(f"{where}: token ids must be >= 0", param="prompt")
    return list(values)


TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only: int() would also read " 5", "+5" and "５"


def token_bias(request: ChatCompletionRequest | CompletionRequest) -> dict[int, float]:
    """The request's logit_bias with its keys read as token ids (JSON keys are strings: "50256").
    Raises InvalidRequest for a key that is not a token id or a value that is not finite."""
    bias = {}
    for key, value in (request.logit_bias or {}).items():
        if not TOKEN_ID.fullmatch(key):
            raise InvalidRequest(
                f'logit_bias keys must be token ids written in decimal digits ("50256"), got {key!r:.40}',
                param="logit_bias",
            )
        check_finite(f"logit_bias.{key}", value)
        bias[int(key)] = value
    return bias


def requested_logprobs(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives per token the request asks for (SamplingParams.logprobs), None if it
    asks for no log-probabilities. The two APIs spell it differently: a chat sends ``logprobs:
    true`` and ``top_logprobs: k`` (0..20), a completion ``logprobs: k`` (0..5)."""
    logprobs, top = request.logprobs, request.top_logprobs
    if isinstance(request, ChatCompletionRequest):
        if logprobs is not None and not isinstance(logprobs, bool):
            raise InvalidRequest(f"logprobs must be true or false, got {logprobs!r:.40}", param="logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
        if not logprobs:
            if top not in (None, 0):
                raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return top or 0
    if top is not None:
        raise InvalidRequest(
            f"top_logprobs is a chat field; a completion asks with logprobs: 0..{MAX_COMPLETION_LOGPROBS}",
            param="top_logprobs",
        )
    if logprobs is None:
        return None
    if type(logprobs) is not int or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:  # (a bool is an int to Python)
        raise InvalidRequest(
            f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] (the alternatives per token), "
            f"got {logprobs!r:.40}",
            param="logprobs",
        )
    return logprobs


API_NAMES = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"}  # SamplingParams' names -> the API's


def in_api_words(message: str) -> str:
    """A SamplingParams error message with its fields named as the API spells them."""
    for name, api_name in API_NAMES.items():
        message = message.replace(name, api_name)
    return message


def to_sampling_params(request: ChatCompletionRequest | CompletionRequest) -> tuple[SamplingParams, bool]:
    """The request's SamplingParams, and whether max_tokens was left out (then the scheduler lets
    it run to the end of the context; max_new_tokens is min_tokens, at least 1, until it does).
    Raises InvalidRequest (param = the API's field name) for a value that cannot be served."""
    raise NotImplementedError(
        "Stage 9: the request's SamplingParams from the OpenAI fields - see stages/s09_zmq_serving/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
    )


# --- responses ------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    """Chat's shape: one object per token, its alternatives inside it, bytes as integers."""

    def one(token: str, data: bytes, logprob: float | None) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(data)}

    return {
        "content": [
            {**one(e.token, e.token_bytes, e.logprob), "top_logprobs": [one(*alt) for alt in e.top or ()]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_token(data: bytes) -> str:
    """A token as the completions API names it: its text, or, for a token that is not whole UTF-8
    (half of "é"), its bytes spelled out as "bytes:\\xc3" (OpenAI's spelling: that API has no
    bytes field, and two halves of characters would otherwise both read U+FFFD)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def completion_logprobs(entries: list[LogprobEntry]) -> dict:
    """The completions API's shape: parallel lists, and the alternatives as {token: logprob}; an
    echoed prompt's first token has null for both (nothing precedes it)."""
    return {
        "tokens": [completion_token(e.token_bytes) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.top is None else {completion_token(data): value for _, data, value in e.top} for e in entries
        ],
        "text_offset": [e.text_offset for e in entries],
    }


def logprobs_field(kind: str, entries: list[LogprobEntry] | None) -> dict | None:
    """A choice's "logprobs" in ``kind``'s shape ("chat" or "completion"); None if not asked."""
    if entries is None:
        return None
    return chat_logprobs(entries) if kind == "chat" else completion_logprobs(entries)


@dataclass
class Choice:
    """One of an answer's n choices, whole: its text, why it ended, its tokens' log-probability
    entries (None if the request did not ask)."""

    text: str
    finish_reason: str | None
    logprobs: list[LogprobEntry] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # chat with tools: the calls read out of the text


def whole_answer(kind: str, rid: str, model: str, choices: list[Choice], counts: tuple[int, int]) -> dict:
    """A whole (not streamed) answer of ``kind``, "chat" or "completion"; ``counts``: its prompt
    tokens (once, however many choices) and its completion tokens (all choices')."""

    def shown(choice: Choice) -> dict[str, Any]:
        if kind == "completion":
            return {"text": choice.text, "logprobs": logprobs_field(kind, choice.logprobs)}
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if choice.tool_calls:  # OpenAI: the content of an answer that only calls tools is null
            message.update(content=choice.text or None, tool_calls=choice.tool_calls)
        return {"message": message, "logprobs": logprobs_field(kind, choice.logprobs)}

    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, **shown(choice), "finish_reason": choice.finish_reason} for i, choice in enumerate(choices)
        ],
        "usage": usage(*counts),
    }


def stream_chunk(
    kind: str,
    rid: str,
    model: str,
    created: int,
    content: dict | str | None,
    finish_reason: str | None = None,
    usage_: dict | None = None,
    logprobs: list[LogprobEntry] | None = None,
    index: int = 0,
) -> dict:
    """One SSE chunk of a streamed answer of ``kind``, "chat" or "completion". ``content``: what
    the chunk adds to its choice, a chat's delta (a dict) or a completion's text; None makes the
    usage-only chunk (no choices). ``logprobs``: the entries of this chunk's tokens (None: the
    request did not ask); ``index``: the choice it belongs to."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
    }
    shown = logprobs_field(kind, logprobs)
    field = "delta" if kind == "chat" else "text"
    chunk["choices"] = (
        [] if content is None else [{"index": index, field: content, "logprobs": shown, "finish_reason": finish_reason}]
    )
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk
