"""Stage 9 (graded): bad input gets OpenAI's error body and the right status, and the server
keeps serving: after each bad request, a good one still works. Hostile values included: strings
no UTF-8 can hold, integers too big for any tensor, floats that are not finite, too many or too
long stop strings, prompts longer than any context could hold."""

from __future__ import annotations

import gzip
import json

import pytest
import requests
from openai import BadRequestError, NotFoundError, OpenAI

from serving_helpers import assert_openai_error, post, read_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return {"model": "llama", "messages": MESSAGES, "max_tokens": 4, **fields}


def without(body: dict, field: str) -> dict:
    return {k: v for k, v in body.items() if k != field}


# (what, path, JSON body or raw text, status, param the error must name (None: any), words the message must hold)
BAD_INPUTS = [
    ("malformed JSON", CHAT, '{"model": "llama", "messages": [', 400, None, "JSON"),
    ("a JSON list instead of an object", CHAT, "[1, 2]", 400, None, "must be a JSON object"),
    ("no messages", CHAT, without(chat(), "messages"), 400, "messages", ""),
    ("messages of the wrong type", CHAT, chat(messages="Hi"), 400, "messages", ""),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages", ""),
    ("a message without content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0.content", ""),
    ("an unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "Hi"}]), 400, "messages.0.role", ""),
    ("no model", CHAT, without(chat(), "model"), 400, "model", ""),
    ("max_tokens = 0", CHAT, chat(max_tokens=0), 400, "max_tokens", ">= 1"),
    ("max_tokens < 0", COMPLETIONS, {"model": "llama", "prompt": "Hi", "max_tokens": -5}, 400, "max_tokens", ""),
    ("max_tokens as a string", CHAT, chat(max_tokens="5"), 400, "max_tokens", ""),
    ("temperature < 0", CHAT, chat(temperature=-0.5), 400, "temperature", ""),
    ("temperature as a string", CHAT, chat(temperature="hot"), 400, "temperature", ""),
    ("top_p = 0", CHAT, chat(top_p=0), 400, "top_p", "(0, 1]"),
    ("top_p > 1", COMPLETIONS, {"model": "llama", "prompt": "Hi", "max_tokens": 4, "top_p": 1.5}, 400, "top_p", ""),
    ("an empty stop string", CHAT, chat(stop=[""]), 400, "stop", ""),
    ("stream as a string", CHAT, chat(stream="yes"), 400, "stream", ""),
    ("n = 0", CHAT, chat(n=0), 400, "n", "[1, 16]"),
    ("n = 17", CHAT, chat(n=17), 400, "n", "[1, 16]"),
    ("best_of = 2", COMPLETIONS, {"model": "llama", "prompt": "Hi", "max_tokens": 4, "best_of": 2}, 400, "best_of", ""),
    ("chat logprobs as a number", CHAT, chat(logprobs=3), 400, "logprobs", "true or false"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "logprobs: true"),
    ("top_logprobs = 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "[0, 20]"),
    (
        "completion logprobs = 6",
        COMPLETIONS,
        {"model": "llama", "prompt": "Hi", "max_tokens": 4, "logprobs": 6},
        400,
        "logprobs",
        "[0, 5]",
    ),
    (
        "completion logprobs as true",
        COMPLETIONS,
        {"model": "llama", "prompt": "Hi", "max_tokens": 4, "logprobs": True},
        400,
        "logprobs",
        "[0, 5]",
    ),
    (
        "top_logprobs on a completion",
        COMPLETIONS,
        {"model": "llama", "prompt": "Hi", "max_tokens": 4, "top_logprobs": 2},
        400,
        "top_logprobs",
        "chat field",
    ),
    (
        "a forced tool call on stage 8's engine",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
        400,
        "tool_choice",
        "stage 11",
    ),
    ("presence_penalty > 2", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty", "[-2, 2]"),
    ("frequency_penalty as a string", CHAT, chat(frequency_penalty="1"), 400, "frequency_penalty", ""),
    ("repetition_penalty = 0", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", "[0.01, 2]"),
    ("a logit_bias key that is a word", CHAT, chat(logit_bias={"the": 5}), 400, "logit_bias", "decimal digits"),
    ("a logit_bias key in full-width digits", CHAT, chat(logit_bias={"\uff15": 5}), 400, "logit_bias", "decimal"),
    ("a negative logit_bias key", CHAT, chat(logit_bias={"-1": 5}), 400, "logit_bias", "decimal digits"),
    ("a logit_bias key past the vocabulary", CHAT, chat(logit_bias={"99999999": 5}), 400, "logit_bias", "vocabulary"),
    (
        "a logit_bias of 101",
        COMPLETIONS,
        {"model": "llama", "prompt": "Hi", "logit_bias": {"5": 101}},
        400,
        "logit_bias",
        "[-100, 100]",
    ),
    (
        "an infinite logit_bias",
        CHAT,
        '{"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"5": 1e400}}',
        400,
        "logit_bias.5",
        "finite",
    ),
    ("min_tokens above max_tokens", CHAT, chat(min_tokens=5), 400, "min_tokens", "max_tokens"),
    (
        "min_tokens beyond the context",
        CHAT,
        without(chat(min_tokens=10**6), "max_tokens"),
        400,
        "min_tokens",
        "context",
    ),
    ("a negative min_tokens", COMPLETIONS, {"model": "llama", "prompt": "Hi", "min_tokens": -1}, 400, "min_tokens", ""),
    (
        "min_tokens past what the context leaves after the prompt",
        CHAT,
        without(chat(min_tokens=1020), "max_tokens"),
        400,
        "min_tokens",
        "fewer than min_tokens=1020",
    ),
    ("a misspelt field", CHAT, chat(temprature=0.5), 400, "temprature", "did you mean temperature?"),
    (
        "a field no message has",
        CHAT,
        chat(messages=[{"role": "user", "content": "Hi", "mood": "sunny"}]),
        400,
        "messages.0.mood",
        "the fields allowed here are role, content, name, tool_calls, tool_call_id",
    ),
    (
        "an empty list of content parts",
        CHAT,
        chat(messages=[{"role": "user", "content": []}]),
        400,
        "messages.0.content",
        "at least one text part",
    ),
    ("no prompt", COMPLETIONS, {"model": "llama", "max_tokens": 4}, 400, "prompt", ""),
    ("an empty body", CHAT, "", 400, None, "the request body is empty; send a JSON object"),
    ("best_of = 0", COMPLETIONS, {"model": "llama", "prompt": "Hi", "best_of": 0}, 400, "best_of", "must be 1"),
    (
        "content parts that are strings",
        CHAT,
        chat(messages=[{"role": "user", "content": ["Hi"]}]),
        400,
        "messages.0.content",
        'must be a string, or a list of parts like {"type": "text", "text": "..."}; messages.0.content.0: ',
    ),
    (
        "a content part with an empty type",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": ""}]}]),
        400,
        "messages.0.content",
        'a list of parts like {"type": "text", "text": "..."}; messages.0.content.0.type: ',
    ),
    (
        "content that is one part, not a list of them",
        CHAT,
        chat(messages=[{"role": "user", "content": {"type": "text", "text": "Hi"}}]),
        400,
        "messages.0.content",
        'a list of parts like {"type": "text", "text": "..."}, got an object',
    ),
    (
        "more content parts than a message may hold",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 1025}]),
        400,
        "messages.0.content",
        "may hold at most 1024 items, got 1025",
    ),
    (
        "a null prompt",
        COMPLETIONS,
        {"model": "llama", "prompt": None},
        400,
        "prompt",
        "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists, got null",
    ),
    ("a prompt that is an object", COMPLETIONS, {"model": "llama", "prompt": {"text": "Hi"}}, 400, "prompt", "object"),
    ("stop strings that are numbers", CHAT, chat(stop=["a", 1]), 400, "stop", "a list of strings; stop.1: "),
    (
        "a batch with an empty prompt",
        COMPLETIONS,
        {"model": "llama", "prompt": ["a", ""], "max_tokens": 4},
        400,
        "prompt",
        "no tokens",
    ),
    ("an unknown model", CHAT, chat(model="gpt-17"), 404, "model", "gpt-17"),
    (
        "an image part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]),
        400,
        "messages.0.content.0",
        "only text parts",
    ),
    (
        "a text part with a field more",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache": 1}]}]),
        400,
        "messages.0.content.0",
        "only text parts",
    ),
    ("an empty prompt", COMPLETIONS, {"model": "llama", "prompt": "", "max_tokens": 4}, 400, "prompt", "no tokens"),
    (
        "a batch of token-id prompts, one empty",
        COMPLETIONS,
        {"model": "llama", "prompt": [[1, 2], []], "max_tokens": 4},
        400,
        "prompt",
        "prompt.1 must not be empty",
    ),
    (
        "a string among token ids",
        COMPLETIONS,
        {"model": "llama", "prompt": [1, "a"], "max_tokens": 4},
        400,
        "prompt",
        "integers",
    ),
    (
        "true as a token id",
        COMPLETIONS,
        {"model": "llama", "prompt": [True], "max_tokens": 4},
        400,
        "prompt",
        "integers",
    ),
    (
        "stream_options without a stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "stream: true",
    ),
    (
        "a body that is not JSON",
        CHAT,
        b'{"model": "llama", "messages": [}',
        400,
        None,
        "not valid JSON at character 32",
    ),
    (
        "a body in UTF-16 (Python's parser would take it; JSON between systems is UTF-8)",
        CHAT,
        json.dumps({"model": "llama", "messages": [{"role": "user", "content": "Hi"}]}).encode("utf-16"),
        400,
        None,
        "not valid UTF-8: byte 0xff at offset 0",
    ),
    (
        "a body that is not UTF-8",
        CHAT,
        b'{"model": "llama", "messages": [{"role": "user", "content": "caf\xe9"}]}',
        400,
        None,
        "not valid UTF-8",
    ),
    (
        "a prompt longer than the context",
        COMPLETIONS,
        {"model": "llama", "prompt": "a" * 1100, "max_tokens": 4},
        400,
        "prompt",
        "context",
    ),
    (
        "a streamed prompt longer than the context",
        COMPLETIONS,
        {"model": "llama", "prompt": "a" * 1100, "max_tokens": 4, "stream": True},
        400,
        "prompt",
        "context",
    ),
    (
        "messages longer than the context",
        CHAT,
        chat(messages=[{"role": "user", "content": "a" * 1100}], max_tokens=4),
        400,
        "messages",
        "context",
    ),
    (
        "prompt plus max_tokens beyond the context",
        CHAT,
        chat(max_tokens=1020),
        400,
        "max_tokens",
        "lower max_tokens to at most",
    ),
    # --- hostile values: each must be refused before it reaches a worker (the server stays up) ---
    (
        "a lone surrogate in a message",
        CHAT,
        chat(messages=[{"role": "user", "content": "Hi \ud800 there"}]),
        400,
        "messages.0.content",
        "surrogate",
    ),
    (
        "a lone surrogate in a content part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]),
        400,
        "messages.0.content.0.text",
        "surrogate",
    ),
    (
        "a lone surrogate in a completion prompt",
        COMPLETIONS,
        {"model": "llama", "prompt": "Hi \udfff", "max_tokens": 4},
        400,
        "prompt",
        "surrogate",
    ),
    ("a lone surrogate in the model name", CHAT, chat(model="lla\ud800ma"), 400, "model", ""),
    ("a lone surrogate in a stop string", CHAT, chat(stop=["\ud800"]), 400, "stop.0", "surrogate"),
    (
        "a lone surrogate in a name",
        CHAT,
        chat(messages=[{"role": "user", "content": "Hi", "name": "\udc00"}]),
        400,
        "messages.0.name",
        "",
    ),
    ("a lone surrogate in a key", CHAT, chat(response_format={"\ud800": 1}), 400, None, "surrogate"),
    (
        "top_k beyond int64",
        COMPLETIONS,
        {"model": "llama", "prompt": "Hi", "max_tokens": 4, "temperature": 1, "top_k": 2**63},
        400,
        "top_k",
        "vocabulary",
    ),
    ("top_k beyond the vocabulary", CHAT, chat(temperature=1, top_k=260), 400, "top_k", "[1, 259]"),
    ("a seed beyond 64 bits", CHAT, chat(seed=2**64), 400, "seed", "2**64 - 1"),
    ("max_tokens beyond the context", CHAT, chat(max_tokens=10**20), 400, "max_tokens", "context"),
    (
        "max_completion_tokens beyond the context",
        CHAT,
        chat(max_tokens=None, max_completion_tokens=2**70),
        400,
        "max_completion_tokens",
        "context",
    ),
    (
        "temperature NaN",
        CHAT,
        '{"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        400,
        "temperature",
        "finite",
    ),
    (
        "temperature Infinity",
        CHAT,
        '{"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "temperature": 1e999}',
        400,
        "temperature",
        "finite",
    ),
    ("top_p an integer too big for a float", CHAT, chat(top_p=10**400), 400, "top_p", "finite"),
    ("more stop strings than allowed", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop", "at most 16"),
    ("a stop string too long", CHAT, chat(stop=["x" * 257]), 400, "stop", "256"),
    ("a model name too long", CHAT, chat(model="m" * 257), 400, "model", ""),
    (
        "more token ids than the context",
        COMPLETIONS,
        {"model": "llama", "prompt": [65] * 1025, "max_tokens": 4},
        400,
        "prompt",
        "context",
    ),
    (
        "a token id beyond int64",
        COMPLETIONS,
        {"model": "llama", "prompt": [65, 2**70], "max_tokens": 4},
        400,
        "prompt",
        "[0, 259)",
    ),
    (
        "a prompt longer than any context could hold (not tokenized)",
        COMPLETIONS,
        {"model": "llama", "prompt": "a" * 20000, "max_tokens": 4},
        400,
        "prompt",
        "refused without tokenizing",
    ),
    (
        "messages longer than any context could hold",
        CHAT,
        chat(messages=[{"role": "user", "content": "é" * 7000}, {"role": "user", "content": "é" * 7000}]),
        400,
        "messages",
        "refused without tokenizing",
    ),
    (
        "a CJK prompt of fewer characters than the context holds tokens (3 tokens each), refused a window in",
        COMPLETIONS,
        {"model": "llama", "prompt": "\u4e2d" * 4000, "max_tokens": 4},
        400,
        "prompt",
        "its first 1024 of 4000 characters already make more",
    ),
    (
        "a CJK chat past the context",
        CHAT,
        chat(messages=[{"role": "user", "content": "\u4e2d" * 4000}]),
        400,
        "messages",
        "refused before the rest was tokenized",
    ),
    (
        "an integer with 5000 digits",
        CHAT,
        '{"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "seed": ' + "9" * 5000 + "}",
        400,
        None,
        "more than 4300 digits",
    ),
    (
        "JSON nested 100000 deep",
        CHAT,
        '{"model": "llama", "messages": ' + "[" * 100000 + "]" * 100000 + "}",
        400,
        None,
        "nested too deeply",
    ),
]

# Refused as too long for the context by a worker (the tokenizer, or the engine itself): OpenAI's code for it.
TOO_LONG_FOR_THE_ENGINE = {
    "a prompt longer than the context",
    "a streamed prompt longer than the context",
    "messages longer than the context",
    "prompt plus max_tokens beyond the context",
    "min_tokens past what the context leaves after the prompt",
    "a CJK prompt of fewer characters than the context holds tokens (3 tokens each), refused a window in",
    "a CJK chat past the context",
}


def assert_good_request_works(server, after: str) -> None:
    answer = post(server, CHAT, chat(max_tokens=3, temperature=0, stream=True))
    assert answer.status_code == 200, (
        f"after {after}, a good streamed request got {answer.status_code}: {answer.text[:300]}"
    )
    chunks = read_sse(answer)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["length"], (
        f"after {after}, a good request (max_tokens 3) should finish once with 'length'; got {finish}"
    )


@pytest.mark.parametrize("what, path, body, status, param, words", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
    tiny_server, what, path, body, status, param, words
):
    answer = post(tiny_server, path, data=body) if isinstance(body, (str, bytes)) else post(tiny_server, path, body)
    error = assert_openai_error(answer, status, what)
    if what in TOO_LONG_FOR_THE_ENGINE:
        assert error["code"] == "context_length_exceeded", (
            f"{what}: the engine refused it as too long, which OpenAI's clients know by the code "
            f"'context_length_exceeded' (send ErrorOut.refused(rid, error)); got {error}"
        )
    if param is not None:
        assert error["param"] == param, f"{what}: the error should name param {param!r}; got {error}"
    assert words in error["message"], f"{what}: the message should say {words!r}; got {error['message']!r}"
    if status == 404:
        assert error["code"] == "model_not_found", (
            f"{what}: OpenAI's code for an unknown model is 'model_not_found'; got {error}"
        )
    assert_good_request_works(tiny_server, what)


def test_a_body_sent_without_the_json_content_type_is_told_what_to_send(tiny_server):
    headers = {**tiny_server.headers, "Content-Type": "text/plain"}
    answer = requests.post(tiny_server.base_url + CHAT, data=json.dumps(chat()), headers=headers, timeout=60)
    assert answer.status_code == 400, f"expected 400, got {answer.status_code}: {answer.text[:300]}"
    message = answer.json()["error"]["message"]
    assert "Content-Type: application/json" in message and "text/plain" in message, (
        f"the error should say to send Content-Type: application/json, and what was sent; got {message!r}"
    )
    assert_good_request_works(tiny_server, "a text/plain body")


def test_a_compressed_body_a_wrong_method_and_an_unknown_path_say_what_is_allowed(tiny_server):
    url, headers = tiny_server.base_url, {**tiny_server.headers, "Content-Type": "application/json"}
    body = gzip.compress(json.dumps(chat()).encode())
    answer = requests.post(url + CHAT, data=body, headers={**headers, "Content-Encoding": "gzip"}, timeout=60)
    assert answer.status_code == 415 and "send the body uncompressed" in answer.json()["error"]["message"], (
        f"a gzip body should be a 415 saying to send it uncompressed; got {answer.status_code} {answer.text[:300]}"
    )
    answer = requests.get(url + CHAT, headers=tiny_server.headers, timeout=60)
    assert answer.status_code == 405 and answer.headers.get("Allow") == "POST", (
        f"GET on {CHAT} should be a 405 with Allow: POST; got {answer.status_code} {dict(answer.headers)}"
    )
    assert "takes POST" in answer.json()["error"]["message"], answer.text[:300]
    answer = requests.post(url + "/v1/chat/completion", data=json.dumps(chat()), headers=headers, timeout=60)
    assert answer.status_code == 404 and CHAT in answer.json()["error"]["message"], (
        f"an unknown path should be a 404 naming the API's paths; got {answer.status_code} {answer.text[:300]}"
    )
    answer = requests.get(url + "/health", headers={"Content-Encoding": "gzip"}, timeout=60)
    assert answer.status_code == 200, (
        f"a request without a body has nothing compressed: its Content-Encoding must not refuse it; got "
        f"{answer.status_code} {answer.text[:300]}"
    )
    assert_good_request_works(tiny_server, "a gzip body, a GET and an unknown path")


def test_the_openai_client_sees_the_errors(tiny_server):
    client = OpenAI(base_url=tiny_server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=4, temperature=-1)
    assert "temperature" in str(caught.value), f"the client's error should explain temperature: {caught.value}"
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    answer = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2, f"a good request after errors should generate 2 tokens: {answer}"


def test_the_model_can_be_retrieved_and_health_answers_head(tiny_server):
    client = OpenAI(base_url=tiny_server.base_url + "/v1", api_key="x", max_retries=0)
    card = client.models.retrieve("llama")
    assert card.id == "llama" and card.object == "model", f"models.retrieve('llama') gave {card}"
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-17")
    head = requests.head(tiny_server.base_url + "/health", headers=tiny_server.headers, timeout=30)
    assert head.status_code == 200, f"HEAD /health (a load balancer's probe) got {head.status_code}"
