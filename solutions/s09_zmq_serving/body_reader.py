"""``BodyReader``: a request's JSON body into its pydantic model, off the event loop when it is large.

One event loop writes every stream this server sends, so whatever one request costs the loop is
a pause in every other client's tokens. Reading JSON into pydantic models and checking it costs a
few microseconds an item, and a body under the size cap holds hundreds of thousands of them: 100
messages of 1,024 content parts (2.9 MiB) took 0.3 s to validate and 0.27 s more to check, and
while it was read on the loop, a stream's tokens and even ``/v1/models`` waited up to 0.74 s (2
cores at load 1.3; 1.6 s at load 4: ``tools/benchmark_large_bodies.py``). So a body
larger than ``INLINE_BYTES`` is read in a thread of the reader's own, one body at a time: the
parser lets the loop have the GIL between its stretches of work, so streams go on (``/v1/models``
then waited at most 0.15 s: the README's threat table has the figures), and a crowd of huge bodies
queues behind that one thread instead of taking a share of the GIL each. A small body, the usual
one, is read on the loop: that costs less than the hop to a thread.

FastAPI would read a route's body itself, on the loop, before the route runs; the generation
routes take the raw ``Request`` instead and read it here, raising the very error FastAPI raises
(``RequestValidationError``, each error's ``loc`` under "body"), so ``http_errors.py`` answers a
bad body the same whichever reads it.
"""

from __future__ import annotations

import asyncio
import email.message
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from .protocol import InvalidRequest

# Up to here a body reads on the loop: 64 KiB of text in 0.1 ms, of the tiniest items (2,340 content
# parts) in 8 ms, a pause no stream notices; the usual body, a few KB, costs less than a thread hop.
INLINE_BYTES = 64 << 10

Body = TypeVar("Body", bound=BaseModel)


class BodyError(RequestValidationError):
    """A body that is not valid JSON, or not the route's model: FastAPI's own error, which also
    carries the model (the handler lists its fields when one is unknown)."""

    def __init__(self, errors: list[dict[str, Any]], model: type[BaseModel]):
        super().__init__(errors)
        self.model = model


class BodyReader:
    """Reads the generation routes' bodies: a small one on the loop, a large one in its one thread."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-reader")

    async def read(
        self, request: Request, model: type[Body], check: Callable[[Body], None] = lambda body: None
    ) -> Body:
        """The request's body as ``model``, then through ``check`` (which raises what it refuses):
        both in the reader's thread when the body is larger than ``INLINE_BYTES``."""
        raw = await request.body()
        content_type = request.headers.get("content-type")
        if len(raw) <= INLINE_BYTES:
            return read_body(raw, content_type, model, check)
        return await asyncio.get_running_loop().run_in_executor(self.pool, read_body, raw, content_type, model, check)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def read_body(raw: bytes, content_type: str | None, model: type[Body], check: Callable[[Body], None]) -> Body:
    """What FastAPI does with a JSON body parameter: an empty body is a missing one; a body sent as
    JSON (``application/json`` or ``application/*+json``) is parsed; any other is validated as the
    bytes it is (and so refused); then ``check``. Where FastAPI would only say "There was an error
    parsing the body", the error says why: JSON nested too deeply, or an integer too long."""
    if not raw:
        raise BodyError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}], model)
    data: Any = raw
    if content_type is not None and is_json(content_type):
        try:
            data = json.loads(raw.decode())  # (UTF-8, as RequestGuard made sure; bytes would be sniffed)
        except RecursionError:
            raise InvalidRequest("the request body is JSON nested too deeply to parse; send a flatter body") from None
        except json.JSONDecodeError as error:
            # (FastAPI's error, which puts the character the parser stopped at in loc)
            raise BodyError(
                [
                    {
                        "type": "json_invalid",
                        "loc": ("body", error.pos),
                        "msg": "JSON decode error",
                        "input": {},
                        "ctx": {"error": error.msg},
                    }
                ],
                model,
            ) from None
        except ValueError as error:
            if "integer string conversion" not in str(error):
                raise
            raise InvalidRequest(
                f"the request body holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                "which the JSON parser refuses; no field of this API takes one"
            ) from None
    try:
        body = model.model_validate(data, from_attributes=True)
    except ValidationError as error:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
        raise BodyError(errors, model) from None
    check(body)
    return body


def is_json(content_type: str) -> bool:
    """``application/json``, or another ``application/...+json`` (parameters such as a charset aside)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
