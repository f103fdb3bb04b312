"""Stage 9's body reader (provided code, not graded): a large body is read off the event loop, which
goes on meanwhile, and whichever way a body is read, a bad one gets FastAPI's own error."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from s09_zmq_serving.body_reader import INLINE_BYTES, BodyError, BodyReader, read_body
from s09_zmq_serving.protocol import ChatCompletionRequest, InvalidRequest

SMALL = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
LARGE = {"model": "m", "messages": [{"role": "user", "content": "x" * (INLINE_BYTES + 1)}]}


class FakeRequest:
    """What the reader takes of a Starlette Request: the body and its headers."""

    def __init__(self, raw: bytes, content_type: str | None = "application/json"):
        self.raw = raw
        self.headers = {} if content_type is None else {"content-type": content_type}

    async def body(self) -> bytes:
        return self.raw


def read(raw: bytes, check=lambda body: None, content_type: str | None = "application/json"):
    async def main():
        reader = BodyReader()
        try:
            return await reader.read(FakeRequest(raw, content_type), ChatCompletionRequest, check)
        finally:
            reader.close()

    return asyncio.run(main())


def test_a_large_body_is_read_in_the_readers_thread_and_a_small_one_on_the_loop():
    where = []

    def check(body):
        where.append(threading.current_thread().name)

    assert read(json.dumps(SMALL).encode(), check).messages[0].content == "Hi"
    assert read(json.dumps(LARGE).encode(), check).messages[0].content == LARGE["messages"][0]["content"]
    assert where[0] == threading.main_thread().name, "a small body should be read on the loop (no thread hop)"
    assert where[1].startswith("body-reader"), f"a large body should be read in the reader's thread, not {where[1]}"


def test_the_loop_runs_while_a_large_body_is_read():
    """The check waits for a coroutine on the loop to run: read on the loop, it would wait forever."""

    async def main():
        loop_ran = threading.Event()

        def check(body):
            assert loop_ran.wait(timeout=10), "the event loop stood still while a large body was read"

        async def beside():
            await asyncio.sleep(0.01)
            loop_ran.set()

        reader = BodyReader()
        try:
            task = asyncio.create_task(beside())
            await reader.read(FakeRequest(json.dumps(LARGE).encode()), ChatCompletionRequest, check)
            await task
        finally:
            reader.close()

    asyncio.run(main())


@pytest.mark.parametrize("size", ["small", "large"])
def test_a_bad_body_gets_fastapis_error_whichever_way_it_is_read(size):
    pad = " " * (INLINE_BYTES + 1) if size == "large" else ""
    broken = pad + '{"model": "m", "messages": [}'
    with pytest.raises(BodyError) as caught:
        read(broken.encode())
    (error,) = caught.value.errors()
    assert (error["type"], error["loc"]) == ("json_invalid", ("body", broken.index("}"))), error  # where it broke
    with pytest.raises(BodyError) as caught:
        read((pad + json.dumps({**SMALL, "temprature": 1})).encode())
    (error,) = caught.value.errors()
    assert (error["type"], error["loc"]) == ("extra_forbidden", ("body", "temprature")), error
    assert caught.value.model is ChatCompletionRequest  # what the handler lists the allowed fields from


def test_what_fastapi_does_not_parse_is_refused_as_it_would_be():
    with pytest.raises(BodyError) as caught:
        read(b"")
    assert [(e["type"], e["loc"]) for e in caught.value.errors()] == [("missing", ("body",))]
    with pytest.raises(BodyError) as caught:  # not sent as JSON: validated as the bytes it is
        read(json.dumps(SMALL).encode(), content_type="text/plain")
    assert caught.value.errors()[0]["loc"] == ("body",)
    assert read(json.dumps(SMALL).encode(), content_type="application/vnd.api+json; charset=utf-8").model == "m"


@pytest.mark.parametrize(
    "raw, says",
    [(b"[" * 100_000, "nested too deeply"), (b'{"seed": ' + b"9" * 5000 + b"}", "more than 4300 digits")],
    ids=["deep", "long integer"],
)
def test_json_the_parser_gives_up_on_says_why(raw, says):
    with pytest.raises(InvalidRequest, match=says):
        read_body(raw, "application/json", ChatCompletionRequest, lambda body: None)
