"""Soak the stage 9 server: minutes of good, malformed, huge, disconnecting and slow clients at
once, then whether it is still whole.

    python tools/soak_serving.py --minutes 10                  # starts a server on the default model
    python tools/soak_serving.py --url http://127.0.0.1:8000   # a server you started with --enable-debug-endpoints
    make soak ARGS="--minutes 2 --clients 8"

Every client thread, until the time is up, picks a kind of client by weight and sends one request
(slow clients have threads of their own, since each one waits for the server's read timeout):

    good        a chat or a completion, streamed or not; the answer must be a well-formed OpenAI answer
    structured  the same with a grammar (a JSON schema as chat's response_format, or a regex, or
                tools with tool_choice "required" or a named function): an answer that ends by
                itself must follow it (a JSON object's keys in the schema's order; each call one of
                the tools', its arguments valid against its schema); one in five gives up after
                0.2 s, while its grammar compiles or runs
    malformed   broken JSON, wrong types, unknown fields, hostile strings (lone surrogates, NUL,
                template syntax) and numbers (2**63, 10**30, NaN, Infinity): an OpenAI error (4xx)
    huge        a body over the server's cap (413), a chat of 20,000 content parts (under the cap,
                read off the event loop: 200), a prompt longer than any context (400), or a long
                generation (256 tokens) read to the end
    disconnect  a stream dropped after a few chunks, or a client that gives up after 0.2 s
    slow        a connection that sends half a request head and waits: the server must close it

An answer that is neither a well-formed OpenAI answer nor OpenAI's error body is a problem; so is
a 5xx (500: the server faulted on a request), except 503 when the server is overloaded (many
clients at once) and 504 past a --request-timeout. At the end, once nothing runs, it prints the
requests served, the answers by kind and status, the problems, the KV slots leaked (slots
neither free nor held by the radix tree: must be 0), every process's resident memory before and
after, and /health; with a server that serves /metrics (the one it starts does), what they say
(each finished request counted once, by how it ended; the latencies' means; every HTTP answer by
status, which must hold no 5xx but 503 and 504, even one sent to a client that had left), which
must show nothing running, queued or holding KV, and no request still timed. The exit status is 1
if anything is wrong.

The request generator and the answer checks are shared with the fuzz test
(tests/stage09/test_serving_fuzz.py), which runs the same hostile bodies through hypothesis.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HOSTILE_STRINGS = [
    "",
    " ",
    "\ud800",
    "a\udfffb",
    "\udc00\ud800",
    "\x00",
    "nul\x00in",
    "\u202e\u2066rtl",
    "\ufeff",
    "💥🔥",
    "é" * 40,
    "<|im_end|>",
    "<|im_start|>system\n",
    "{{ 7 * 7 }}",
    "{% for x in range(10**9) %}{% endfor %}",
    "\\",
    '"',
    "\n" * 20,
    "x" * 300,
    "llama",
    "user",
    "text",
]
HOSTILE_NUMBERS = [
    0,
    -1,
    1,
    2,
    4,
    16,
    259,
    260,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63) - 1,
    10**30,
    10**400,
    0.5,
    -0.0,
    1e-320,
    1.5,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
]
FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "logprobs",
    "top_logprobs",
    "user",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "echo",
    "not_a_field",
]
PROMPTS = ["Hi", "Tell me a story.", "héllo wörld ☃ 中文", "1 + 1 =", "a\nb\n\nc"]
# what /debug/state counts of the requests the detokenizer still keeps (0 for all once idle)
DETOKENIZER_KEEPS = ("detokenizer_requests", "detokenizer_logprob_streams", "detokenizer_failed")
BUSY = {503, 504}  # an overloaded server (many clients at once), a request past --request-timeout
KINDS = {"good": 0.35, "structured": 0.12, "malformed": 0.28, "huge": 0.07, "disconnect": 0.18}  # of the threads
# The grammars of structured clients: small enough that most answers end by themselves in 24 tokens
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["b", "a"]}},
        "required": ["n", "tag"],
        "additionalProperties": False,
    },
]
REGEXES = [r"(yes|no)", r"[0-9]{1,3}", r"(cat|dog)s?!", r"é+ ☃"]
# The tools of structured clients that call them: a function per schema
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}} for i, schema in enumerate(SCHEMAS)
]


# --- requests -----------------------------------------------------------------------------------


def hostile_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if roll < 0.35:
        return rng.choice(HOSTILE_STRINGS)
    if roll < 0.7:
        return rng.choice(HOSTILE_NUMBERS)
    if roll < 0.8:
        return rng.choice([None, True, False])
    if depth >= 2:
        return rng.choice(HOSTILE_STRINGS)
    if roll < 0.9:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(HOSTILE_STRINGS + FIELDS): hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def good_body(rng: random.Random, model: str, chat: bool) -> dict:
    max_tokens = rng.randint(1, 8)
    body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = (
            rng.choice(PROMPTS) if rng.random() < 0.8 else [rng.randrange(0, 200) for _ in range(rng.randint(1, 8))]
        )
    if not chat and rng.random() < 0.2:  # the answer starts with the prompt (with logprobs: its entries too)
        body["echo"] = True
    if rng.random() < 0.3:  # log-probabilities, as each API spells them
        body.update({"logprobs": True, "top_logprobs": rng.randint(0, 5)} if chat else {"logprobs": rng.randint(0, 5)})
    elif rng.random() < 0.2:  # several choices (their answers are checked by shape and count)
        body["n"] = rng.randint(2, 4)
        if not chat and rng.random() < 0.5:  # for a batch of prompts: n choices each
            body["prompt"] = [rng.choice(PROMPTS) for _ in range(rng.randint(2, 4))]
    if rng.random() < 0.2:  # penalties and a bias (the answer is checked by shape only)
        body["presence_penalty"], body["frequency_penalty"] = rng.uniform(-2, 2), rng.uniform(-2, 2)
        body["repetition_penalty"] = rng.uniform(0.5, 2)
        body["logit_bias"] = {str(rng.randrange(0, 200)): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))}
        body["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": rng.random() < 0.5}
    return body


def mutate(body: dict, rng: random.Random) -> None:
    """One hostile change: a field set to a hostile value, a message (or prompt id) spoiled, or a field dropped."""
    roll, messages = rng.random(), body.get("messages")
    if roll < 0.25 and isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        message = dict(rng.choice(messages))
        message[rng.choice(["role", "content", "name", "tool_calls", "tool_call_id"])] = hostile_value(rng)
        body["messages"] = [*body["messages"], message][-rng.randint(1, 2) :]
    elif roll < 0.35 and isinstance(body.get("prompt"), list):
        body["prompt"] = [*body["prompt"], rng.choice(HOSTILE_NUMBERS)]
    elif roll < 0.45:
        body.pop(
            rng.choice([f for f in FIELDS if f != "max_tokens"]), None
        )  # never max_tokens: a run to the end of the context is slow
    else:
        field = rng.choice(FIELDS)
        body[field] = hostile_value(rng)
        while field == "max_tokens" and body[field] is None:  # null is absent (minutes on a CPU, past the client's
            body[field] = hostile_value(rng)  # timeout: the soak counted the wait as a problem)


def hostile_request(rng: random.Random, model: str) -> tuple[str, bytes, dict | None]:
    """(path, raw body, the body as sent or None when it is not a JSON object): a good request
    spoiled by 0-3 hostile changes, or now and then bytes that are not JSON at all."""
    chat = rng.random() < 0.5
    path = CHAT if chat else COMPLETIONS
    if rng.random() < 0.05:
        return path, rng.choice([b"", b"{", b"[1, 2]", b"null", b'{"model": "\xff\xfe"}', b"\x00" * 10]), None
    body = good_body(rng, model, chat)
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        mutate(body, rng)
    # Python's JSON: NaN / Infinity literals, lone surrogates as \ud800 escapes (legal JSON, both)
    return path, json.dumps(body).encode(), body


# --- answers ------------------------------------------------------------------------------------


def error_problems(payload) -> list[str]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return [f"not OpenAI's error body: {str(payload)[:200]}"]
    if not (isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)):
        return [f"an error without a message or a type: {error}"]
    return []


def stream_problems(chunks: list[dict], chat: bool, include_usage: bool, n: int = 1) -> list[str]:
    """A streamed answer's JSON chunks (without [DONE]): the right object; for each of its ``n``
    choices (by index), exactly one finish reason, on that choice's last chunk; a usage-only last
    chunk if and only if asked."""
    wanted = "chat.completion.chunk" if chat else "text_completion"
    if errors := [c for c in chunks if "error" in c]:
        return [f"the stream carried an error: {errors[0]}"]
    problems = []
    if {c.get("object") for c in chunks} != {wanted}:
        problems.append(
            f"every chunk's object must be {wanted!r}; got {sorted({str(c.get('object')) for c in chunks})}"
        )
    with_choices = [c for c in chunks if c.get("choices")]
    by_index: dict = {}
    for c in with_choices:
        for choice in c["choices"]:
            by_index.setdefault(choice.get("index"), []).append(choice)
    indices = sorted(by_index, key=lambda i: (0, i, "") if isinstance(i, int) else (1, 0, str(i)))
    if indices != list(range(n)):
        problems.append(f"{n} choice(s) numbered 0..{n - 1}; got the indices {indices}")
    for index, choices in by_index.items():
        finishes = [ch.get("finish_reason") for ch in choices if ch.get("finish_reason")]
        if len(finishes) != 1 or not choices[-1].get("finish_reason"):
            problems.append(f"choice {index}: exactly one finish reason, on its last chunk; got {finishes}")
    usage = [c for c in chunks if c.get("usage")]
    if include_usage and not (len(usage) == 1 and chunks[-1] is usage[0] and not chunks[-1]["choices"]):
        problems.append(
            f"include_usage asks for one last chunk with the usage and no choices; got {len(usage)} usage "
            f"chunk(s), the last chunk being {chunks[-1] if chunks else None}"
        )
    if not include_usage and (usage or len(with_choices) != len(chunks)):
        problems.append(
            "without stream_options.include_usage a stream has no usage chunk (and no chunk without choices); "
            f"got {[c for c in chunks if c.get('usage') or not c.get('choices')][:2]}"
        )
    return problems


def choices_asked(body: dict | None) -> int:
    """How many choices a well-formed answer to ``body`` holds: its n (1 if absent) for each prompt
    of a batch (a prompt that is a list of strings and lists)."""
    n = body.get("n") if isinstance(body, dict) else None
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return n * len(prompt)
    return n


def answer_problems(path: str, body: dict | None, answer: requests.Response, allowed: set[int]) -> list[str]:
    """Why ``answer`` is not a well-formed OpenAI answer or error (empty list: it is)."""
    status, raw = answer.status_code, answer.content
    if status not in allowed:
        return [f"status {status}: {raw[:300]!r}"]
    if status != 200:
        try:
            return error_problems(json.loads(raw))
        except ValueError:
            return [f"a {status} whose body is not JSON: {raw[:200]!r}"]
    chat = path == CHAT
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        if not events or events[-1] != b"[DONE]":
            return [f"a stream must end with data: [DONE]; its last events were {events[-2:]}"]
        try:
            chunks = [json.loads(e) for e in events[:-1]]
        except ValueError as error:
            return [f"a stream event that is not JSON ({error})"]
        options = body.get("stream_options") if isinstance(body, dict) else None
        asked_usage = isinstance(options, dict) and options.get("include_usage") is True
        return stream_problems(chunks, chat, asked_usage, choices_asked(body))
    try:
        payload = json.loads(raw)
        choices, use = payload["choices"], payload["usage"]
        # a chat's answer that calls tools: content null (or text before the calls), finish "tool_calls"
        calls = [chat and bool(choice["message"].get("tool_calls")) for choice in choices]
        texts = [choice["message"]["content"] if chat else choice["text"] for choice in choices]
        ok = (
            payload["object"] == ("chat.completion" if chat else "text_completion")
            and [choice["index"] for choice in choices] == list(range(choices_asked(body)))
            and all(isinstance(text, str) or (text is None and called) for text, called in zip(texts, calls))
            and all(
                choice["finish_reason"] in ("stop", "length") or (choice["finish_reason"] == "tool_calls" and called)
                for choice, called in zip(choices, calls)
            )
            and use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]
            and use["completion_tokens"] >= len(choices)
        )
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return [f"a 200 that is not an OpenAI answer ({type(error).__name__}): {raw[:200]!r}"]
    return [] if ok else [f"a malformed OpenAI answer: {raw[:300]!r}"]


def answer_choices(answer: requests.Response) -> list[dict]:
    """A 200 answer's choices: the one of a whole answer, or every chunk's, in order."""
    if not answer.headers.get("content-type", "").startswith("text/event-stream"):
        return answer.json()["choices"]
    return [
        choice
        for line in answer.content.split(b"\n")
        if line.startswith(b"data: {")
        for choice in json.loads(line[len(b"data: ") :]).get("choices", [])
    ]


def token_bytes(token: str) -> bytes:
    """A completions API token's bytes: its text, or the bytes spelled out ("bytes:\\xc3")."""
    if token.startswith("bytes:"):
        return bytes(int(token[i + 2 : i + 4], 16) for i in range(len("bytes:"), len(token), 4))
    return token.encode()


def logprob_problems(chat: bool, body: dict, choices: list[dict], text: str) -> list[str]:
    """An answer that asked for log-probabilities: its entries' bytes joined spell its text, every
    logprob is a finite number <= 0, and each entry has the number of alternatives asked for
    (with echo, the prompt's first token has neither: null)."""
    k = body["top_logprobs"] if chat else body["logprobs"]
    shown = [choice.get("logprobs") for choice in choices]
    if any(not isinstance(s, dict) for s in shown if s is not None) or all(s is None for s in shown):
        return [f"asked for logprobs, got {str(shown)[:200]}"]
    pieces: list[bytes] = []
    values, tops = [], []
    problems, started = [], set()  # the choices whose first entries were seen (a stream splits them)
    for choice, s in zip(choices, shown):
        if s is None:
            continue
        if chat:
            pieces += [bytes(e["bytes"]) for e in s["content"]]
            values += [e["logprob"] for e in s["content"]]
            tops += [len(e["top_logprobs"]) for e in s["content"]]
        else:
            pieces += map(token_bytes, s["tokens"])
            logprobs, top_logprobs = s["token_logprobs"], s["top_logprobs"]
            first = logprobs and choice.get("index") not in started
            if logprobs:
                started.add(choice.get("index"))
            if body.get("echo") and first and logprobs[:1] == [None] and top_logprobs[:1] == [None]:
                logprobs, top_logprobs = logprobs[1:], top_logprobs[1:]  # the echoed prompt's first token
            elif body.get("echo") and first:
                problems.append(f"echo: the prompt's first token should have null logprobs, got {logprobs[:1]}")
            values += logprobs
            tops += [len(top) if isinstance(top, dict) else -1 for top in top_logprobs]
    # An echoed prompt and its answer are decoded each on its own: a token-id prompt that ends
    # inside a character shows its part of it as U+FFFD (and the answer's first bytes too).
    prompt = body.get("prompt")
    cut = len(prompt) if body.get("echo") and isinstance(prompt, list) else 0
    data = b"".join(pieces)
    if b"".join(pieces[:cut]).decode("utf-8", "replace") + b"".join(pieces[cut:]).decode("utf-8", "replace") != text:
        problems.append(f"the entries' bytes spell {data[:80]!r}, the text is {text[:80]!r}")
    if not all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in values):
        problems.append(f"a logprob that is not a finite number <= 0: {values[:10]}")
    if any(
        n > k or n < 0 or (chat and n != k) for n in tops
    ):  # (a completion's {token: logprob} may merge equal texts)
        problems.append(f"asked for {k} alternatives per token, got {tops[:10]}")
    return problems


def answer_texts(path: str, answer: requests.Response) -> list[tuple[str, str | None]]:
    """A 200 answer's whole text and finish reason per choice (by index), streamed or not."""
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    for choice in answer_choices(answer):
        index = choice.get("index", 0)
        if path != CHAT:
            piece = choice["text"]
        else:
            piece = (choice["message"] if "message" in choice else choice["delta"]).get("content") or ""
        texts[index] = texts.get(index, "") + piece
        finishes[index] = choice["finish_reason"] or finishes.get(index)
    return [(texts[i], finishes[i]) for i in sorted(texts)]


def answer_calls(answer: requests.Response) -> list[tuple[list[tuple[str, str]], str | None]]:
    """A 200 chat answer's tool calls (name, arguments) and finish reason per choice, streamed or not."""
    calls: dict[int, dict[int, list[str]]] = {}
    finishes: dict[int, str | None] = {}
    for choice in answer_choices(answer):
        index = choice.get("index", 0)
        for j, call in enumerate(
            (choice["message"] if "message" in choice else choice["delta"]).get("tool_calls") or []
        ):
            place = calls.setdefault(index, {}).setdefault(call.get("index", j), ["", ""])
            place[0] += call["function"].get("name") or ""
            place[1] += call["function"].get("arguments") or ""
        finishes[index] = choice["finish_reason"] or finishes.get(index)
    return [([(n, a) for n, a in (calls.get(i) or {}).values()], finishes[i]) for i in sorted(finishes)]


def call_problems(calls: list[tuple[str, str]], tool_choice) -> list[str]:
    """Why the calls of an answer that ended by itself do not follow the tools and tool_choice."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    if not calls or (named is not None and [name for name, _ in calls] != [named]):
        return [f"tool_choice {tool_choice}: the calls {calls} are not what it forces"]
    return [p for name, arguments in calls for p in grammar_problems(arguments, schemas.get(name), None)]


def grammar_problems(text: str, schema: dict | None, regex: str | None) -> list[str]:
    """Why ``text``, an answer that ended by itself, does not follow its grammar."""
    if regex is not None:
        return [] if re.fullmatch(regex, text) else [f"{text!r} does not match the regex {regex!r}"]
    import jsonschema

    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
    except (ValueError, jsonschema.ValidationError) as error:
        return [f"{text!r} does not follow its JSON schema ({type(error).__name__})"]
    if list(value) != list(schema["properties"]):
        return [f"{text!r} writes its keys as {list(value)}, the schema lists {list(schema['properties'])}"]
    return []


# --- the soak -----------------------------------------------------------------------------------


class Soak:
    def __init__(self, base_url: str, model: str, seconds: float, headers: dict[str, str], guards: dict):
        self.base_url, self.model, self.headers = base_url, model, {**headers, "Content-Type": "application/json"}
        self.deadline = time.monotonic() + seconds
        self.guards = guards  # the server's limits, from /debug/state
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.problems: list[str] = []
        self.lock = threading.Lock()
        self.sent = threading.local()  # each client's last request, named when it fails (to replay it)

    def record(self, kind: str, outcome: str, problems: Sequence[str] = ()) -> None:
        with self.lock:
            self.outcomes[kind, outcome] += 1
            self.problems += [f"{kind}: {p}" for p in problems]

    def post(self, path: str, data: bytes, timeout: float = 120, stream: bool = False) -> requests.Response:
        self.sent.request = f"POST {path} {data[:400]!r}{' ...' if len(data) > 400 else ''}"
        return requests.post(self.base_url + path, data=data, headers=self.headers, timeout=timeout, stream=stream)

    def client(self, seed: int, slow: bool = False) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            kind = "slow" if slow else rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            self.sent.request = None
            try:
                getattr(self, kind)(rng)
            except (requests.RequestException, OSError) as error:
                sent = f" (the request: {self.sent.request})" if self.sent.request else ""
                self.record(
                    kind, f"client error {type(error).__name__}", [f"{type(error).__name__}: {str(error)[:200]}{sent}"]
                )

    def good(self, rng: random.Random) -> None:
        body = good_body(rng, self.model, rng.random() < 0.5)
        path = CHAT if "messages" in body else COMPLETIONS
        answer = self.post(path, json.dumps(body).encode())
        problems, outcome = answer_problems(path, body, answer, {200, *BUSY}), str(answer.status_code)
        if not problems and answer.status_code == 200 and "logprobs" in body:
            [(text, _)] = answer_texts(path, answer)  # (a body with logprobs asks for one choice)
            problems = logprob_problems(path == CHAT, body, answer_choices(answer), text)
            outcome = "200, logprobs checked against the text"
        if not problems and answer.status_code == 200 and body.get("echo") and isinstance(body["prompt"], str):
            problems = [
                f"echo: the answer {text[:60]!r} does not start with the prompt {body['prompt'][:60]!r}"
                for text, _ in answer_texts(path, answer)
                if not text.startswith(body["prompt"])
            ]
            outcome += ", echo checked"
        self.record("good", outcome, problems)

    def structured(self, rng: random.Random) -> None:
        chat = rng.random() < 0.5
        body = {**good_body(rng, self.model, chat), "max_tokens": 24}
        body.pop("min_tokens", None)  # a grammar decides where its output ends: min_tokens is refused with one
        body.pop("echo", None)  # (the answer alone is checked against its grammar)
        roll = rng.random()
        schema, regex = (rng.choice(SCHEMAS), None) if chat and roll < 0.6 else (None, rng.choice(REGEXES))
        tool_choice = None
        if chat and roll < 0.3:  # calls forced by tool_choice: the answer is held to the tools' schemas
            named = {"type": "function", "function": {"name": TOOLS[-1]["function"]["name"]}}
            tool_choice = rng.choice(["required", named])
            body.update(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=rng.random() < 0.5)
        elif schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "soak", "schema": schema}}
        else:
            body["regex"] = regex
        path = CHAT if chat else COMPLETIONS
        give_up = rng.random() < 0.2
        try:
            answer = self.post(path, json.dumps(body).encode(), timeout=0.2 if give_up else 120)
        except (requests.Timeout, requests.ConnectionError):  # a stream's body read past 0.2 s: ConnectionError
            if not give_up:
                raise
            self.record("structured", "gave up after 0.2 s")
            return
        if answer.status_code == 400 and "stage 11's engine" in answer.text:  # a server without grammars
            self.record("structured", "400 (this server has no grammars)")
            return
        problems, outcome = answer_problems(path, body, answer, {200, *BUSY}), str(answer.status_code)
        if not problems and answer.status_code == 200 and tool_choice is not None:
            made = [calls for calls, finish in answer_calls(answer) if finish != "length"]
            problems = [problem for calls in made for problem in call_problems(calls, tool_choice)]
            outcome = "200, calls: checked against the tools" if made else "200, calls cut at max_tokens"
        elif not problems and answer.status_code == 200:
            ended = [text for text, finish in answer_texts(path, answer) if finish == "stop"]
            problems = [problem for text in ended for problem in grammar_problems(text, schema, regex)]
            outcome = "200, ended: checked against its grammar" if ended else "200, cut at max_tokens"
        self.record("structured", outcome, problems)

    def malformed(self, rng: random.Random) -> None:
        path, data, body = hostile_request(rng, self.model)
        answer = self.post(path, data)
        self.record(
            "malformed", str(answer.status_code), answer_problems(path, body, answer, {200, 400, 404, 413, *BUSY})
        )

    def huge(self, rng: random.Random) -> None:
        roll, cap = rng.random(), self.guards["max_request_bytes"]
        path = COMPLETIONS
        if roll < 0.25:  # a body over the cap
            body = {"model": self.model, "prompt": "x" * (cap + 1), "max_tokens": 2}
            allowed = {413}
        elif roll < 0.4:  # valid, and large only in items: read off the event loop (body_reader.py)
            parts = [{"type": "text", "text": ""}] * 1000 + [{"type": "text", "text": rng.choice(PROMPTS)}]
            body = {"model": self.model, "messages": [{"role": "user", "content": parts}] * 20, "max_tokens": 2}
            path, allowed = CHAT, {200, *BUSY}
        elif roll < 0.6:  # a prompt no context can hold: refused before it is tokenized
            body = {
                "model": self.model,
                "prompt": "a" * min(cap - 100, self.guards["max_prompt_chars"] + 1),
                "max_tokens": 2,
            }
            allowed = {400, *BUSY}
        else:  # a long generation, read to the end
            body = {
                "model": self.model,
                "prompt": rng.choice(PROMPTS),
                "max_tokens": 256,
                "ignore_eos": True,
                "stream": True,
            }
            allowed = {200, *BUSY}
        answer = self.post(path, json.dumps(body).encode())
        self.record("huge", str(answer.status_code), answer_problems(path, body, answer, allowed))

    def disconnect(self, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True}
        if rng.random() < 0.6:  # a stream dropped after a few chunks
            with self.post(COMPLETIONS, json.dumps({**body, "stream": True}).encode(), stream=True) as answer:
                if answer.status_code != 200:
                    self.record("disconnect", str(answer.status_code), answer_problems(COMPLETIONS, body, answer, BUSY))
                    return
                for _, _ in zip(range(rng.randint(1, 5)), answer.iter_lines()):
                    pass
            self.record("disconnect", "dropped a stream")
        else:  # a client that gives up
            try:
                answer = self.post(COMPLETIONS, json.dumps(body).encode(), timeout=0.2)
                self.record(
                    "disconnect", str(answer.status_code), answer_problems(COMPLETIONS, body, answer, {200, *BUSY})
                )
            except requests.Timeout:
                self.record("disconnect", "gave up after 0.2 s")

    def slow(self, rng: random.Random) -> None:
        where = urlsplit(self.base_url)
        with socket.create_connection((where.hostname, where.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n")
            sock.settimeout(max(5.0, self.deadline - time.monotonic() + 60))
            try:
                closed = sock.recv(1000) == b""
            except (TimeoutError, OSError):
                closed = False
        self.record(
            "slow",
            "closed by the server" if closed else "NOT closed",
            [] if closed else ["a half-sent request head was never cut off"],
        )


def rss_mib(pid: int) -> float | None:
    """A process's resident memory (Linux /proc), None if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def debug_state(base_url: str, headers: dict) -> dict:
    answer = requests.get(base_url + "/debug/state", headers=headers, timeout=60)
    if answer.status_code != 200:
        raise SystemExit(
            f"GET /debug/state answered {answer.status_code}: start the server with --enable-debug-endpoints "
            "(the soak reads the pids, the memory and the invariants there)"
        )
    return answer.json()


def wait_idle(base_url: str, headers: dict, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = debug_state(base_url, headers)
        if state["running"] == state["waiting"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus' text format as {name: value}, a sample's labels other than model_name as the
    values in braces ('name{stop}' for a finish reason's counter, 'name{/v1/completions,400}' for an
    HTTP count; histograms' buckets left out), parsed by prometheus_client's own parser: malformed
    text raises."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(value for name, value in sample.labels.items() if name != "model_name")
            if not sample.name.endswith(("_bucket", "_created")):
                samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def read_metrics(base_url: str, headers: dict) -> dict[str, float] | None:
    """/metrics' samples (metric_samples); None if the server does not serve it."""
    answer = requests.get(base_url + "/metrics", headers=headers, timeout=60)
    if answer.status_code == 404:
        return None
    answer.raise_for_status()
    return metric_samples(answer.text)


def metrics_line(metrics: dict[str, float]) -> str:
    def mean(name: str) -> str:
        count = metrics.get(f"engine:{name}_count", 0)
        return f"{1000 * metrics[f'engine:{name}_sum'] / count:.1f} ms" if count else "-"

    finished = ", ".join(
        f"{name[name.index('{') + 1 : -1]} {value:.0f}"
        for name, value in sorted(metrics.items())
        if name.startswith("engine:requests_finished_total{")
    )
    return (
        f"/metrics: finished requests by reason: {finished}; "
        f"mean time to first token {mean('time_to_first_token_seconds')}, "
        f"between tokens {mean('inter_token_latency_seconds')}, end to end {mean('e2e_request_latency_seconds')}; "
        f"cache hit rate {metrics['engine:cache_hit_rate']:.2f}; now running {metrics['engine:num_running_reqs']:.0f}, "
        f"queued {metrics['engine:num_queue_reqs']:.0f}, token usage {metrics['engine:token_usage']:.2f}"
    )


def grown(before: dict[str, float], after: dict[str, float], metric: str) -> dict[str, int]:
    """How much each labelled series of the counter ``metric`` grew between two scrapes
    (metric_samples), by its labels' values ('stop', '/v1/completions,400'); those that did not grow
    are left out."""
    prefix = metric + "{"
    growth = {
        name[len(prefix) : -1]: round(value - before.get(name, 0.0))
        for name, value in after.items()
        if name.startswith(prefix)
    }
    return {labels: n for labels, n in growth.items() if n}


def http_answers(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The HTTP answers the server counted between two scrapes (engine:http_requests_total), by status."""
    answered: dict[str, int] = {}
    for labels, n in grown(before, after, "engine:http_requests_total").items():
        status = labels.rsplit(",", 1)[1]
        answered[status] = answered.get(status, 0) + n
    return answered


def soak(base_url: str, minutes: float, clients: int, slow_clients: int, api_key: str | None, seed: int) -> int:
    from tqdm import tqdm

    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    models = requests.get(base_url + "/v1/models", headers=headers, timeout=60).json()["data"][0]
    before = debug_state(base_url, headers)
    metrics_before = read_metrics(base_url, headers) or {}
    rss_before = {name: rss_mib(pid) for name, pid in before["pids"].items()}
    runner = Soak(base_url, models["id"], minutes * 60, headers, before["guards"])
    threads = [
        threading.Thread(target=runner.client, args=(seed + i, i >= clients), daemon=True)
        for i in range(clients + slow_clients)
    ]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    with tqdm(total=round(minutes * 60), unit="s", desc=f"soak, {clients}+{slow_clients} clients") as bar:
        scrapes = 0
        while any(thread.is_alive() for thread in threads):
            time.sleep(1)
            scrapes += 1
            if scrapes % 5 == 0:  # a Prometheus scraping the server under load: /metrics must answer
                try:
                    read_metrics(base_url, headers)
                    runner.record("metrics", "200")
                except Exception as error:
                    runner.record(
                        "metrics", "failed", [f"GET /metrics under load: {type(error).__name__}: {error}"[:300]]
                    )
            bar.n = min(bar.total, round(time.monotonic() - start))
            bar.set_postfix(requests=sum(runner.outcomes.values()), problems=len(runner.problems), refresh=True)
    elapsed = time.monotonic() - start
    after = wait_idle(base_url, headers)
    health = requests.get(base_url + "/health", timeout=60)
    metrics = read_metrics(base_url, headers)
    leaked = after["pool_size"] - after["free_slots"] - after["tree_cached_tokens"]

    total = sum(runner.outcomes.values())
    served = sum(n for (kind, outcome), n in runner.outcomes.items() if outcome.startswith("200"))
    print(
        f"\n{total} requests in {elapsed:.0f} s from {clients} + {slow_clients} slow clients ({total / elapsed:.1f} "
        f"req/s) against {base_url} "
        f"({models['id']}, device {after['device']}); {served} answered 200"
    )
    print("answers by kind of client:")
    for kind in [*KINDS, "slow", "metrics"]:
        row = sorted(((outcome, n) for (k, outcome), n in runner.outcomes.items() if k == kind), key=lambda x: -x[1])
        print(f"  {kind:11s} " + ", ".join(f"{outcome}: {n}" for outcome, n in row))
    print(f"problems (neither a well-formed OpenAI answer nor its error body, or a 5xx): {len(runner.problems)}")
    for problem in runner.problems[:10]:
        print(f"  {problem}")
    detokenizer_kept = sum(after[key] for key in DETOKENIZER_KEEPS)
    print(
        f"leaked KV slots: {leaked} (pool {after['pool_size']}, free {after['free_slots']}, radix tree "
        f"{after['tree_cached_tokens']}); requests still kept: scheduler {after['tracked_requests']}, detokenizer "
        f"{detokenizer_kept}, API server {after['open_requests']}; "
        f"invariants: {after['invariants']}"
    )
    print("resident memory (MiB)    before    after")
    for name, pid in after["pids"].items():
        now = rss_mib(pid)
        print(f"  {name:12s} {pid:>8d} {rss_before.get(name) or float('nan'):9.1f} {now or float('nan'):8.1f}")
    print(f"health at the end: {health.status_code} {health.text[:200]}")
    print(
        metrics_line(metrics)
        if metrics is not None
        else "/metrics: not served (start the server with --enable-metrics)"
    )
    faults = {}
    if metrics is not None:
        answered = http_answers(metrics_before, metrics)
        print(
            "the server's own count of its answers (/metrics), by status: "
            + (", ".join(f"{status}: {n}" for status, n in sorted(answered.items())) or "none")
        )
        # what the clients saw is checked above; this also covers answers no client stayed to read
        faults = {status: n for status, n in answered.items() if int(status) >= 500 and int(status) not in BUSY}
        if faults:
            print(f"  server faults among them: {faults}")
    idle_metrics = metrics is None or (
        metrics["engine:num_running_reqs"] == metrics["engine:num_queue_reqs"] == metrics["engine:token_usage"] == 0
        and after.get("timed_requests", 0) == 0
    )
    whole = (
        idle_metrics
        and not faults
        and not runner.problems
        and leaked == 0
        and after["invariants"] == "ok"
        and after["tracked_requests"] == detokenizer_kept == 0
        and after["open_requests"] == 0
        and health.status_code == 200
    )
    print("the server came through whole" if whole else "THE SERVER DID NOT COME THROUGH WHOLE")
    return 0 if whole else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=12, help="client threads sending requests")
    parser.add_argument(
        "--slow-clients", type=int, default=2, help="client threads that send half a request head and wait"
    )
    parser.add_argument("--url", default=None, help="soak this running server (started with --enable-debug-endpoints)")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    parser.add_argument(
        "--model", default=None, help="model folder for the server it starts (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--server-args", default="", help="more flags for the server it starts, e.g. '--max-running-requests 32'"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.url:
        return soak(args.url.rstrip("/"), args.minutes, args.clients, args.slow_clients, args.api_key, args.seed)

    import tempfile

    import impl_switch

    impl_switch.install()
    from s00_foundation.paths import default_model_path
    from s09_zmq_serving.server_process import ServerProcess

    model = str(args.model or default_model_path())
    with tempfile.NamedTemporaryFile("w", prefix="soak-server-", suffix=".log", delete=False) as log:
        print(f"starting the server on {model} (its log: {log.name}) ...", flush=True)
        flags = ["--enable-debug-endpoints", "--enable-metrics"]
        server = ServerProcess(["--model", model, *flags, *args.server_args.split()], log=log)
        try:
            server.wait_ready()
            return soak(server.base_url, args.minutes, args.clients, args.slow_clients, args.api_key, args.seed)
        finally:
            code = server.stop()
            print(f"server stopped (exit code {code})")


if __name__ == "__main__":
    sys.exit(main())
