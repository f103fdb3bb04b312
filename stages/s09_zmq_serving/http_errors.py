"""OpenAI's error answers, whatever refuses a request: this server's own checks, or the web
framework under them.

OpenAI's clients read every error as one JSON shape and expect 400 for a request they got wrong::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_k", "code": null}}

FastAPI would answer a body that fails validation (``body_reader.py`` raises FastAPI's own error)
with 422 and its own list of problems, Starlette a path it does not know with a bare "Not Found",
and an unexpected exception with plain text. ``install_error_handlers`` makes each of them answer
in OpenAI's shape instead, saying what was wrong (the field, the character where the JSON broke,
the method a path takes), and every answer renders, even one that echoes a string no UTF-8 can
hold. (A body that is not UTF-8 is refused before, by ``RequestGuard``.)
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from .io_struct import describe_error
from .protocol import FIELD_SHAPES, InvalidRequest, error_body

CLIENT_CLOSED_REQUEST = 499  # the status logged for a request whose client left (nginx's convention)
FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
UNION_TAGS = {"float", "int", "str", "bool"}  # how pydantic names the member of a union it tried


def fields_at(model: type[BaseModel], path: typing.Sequence[str | int]) -> list[str]:
    """The fields an object at ``path`` inside a request body of ``model`` may have (in the order
    the model declares them), found by walking the model's annotations: a field's type, a list's
    items, each member of a union. [] where no strict model describes that object."""
    found: list[typing.Any] = [model]
    for part in path:
        found = [step for kind in found for member in union_members(kind) for step in walk(member, part)]
    names = [
        name
        for kind in found
        for member in union_members(kind)
        if isinstance(member, type) and issubclass(member, BaseModel) and member.model_config.get("extra") == "forbid"
        for name in member.model_fields
    ]
    return list(dict.fromkeys(names))


def union_members(kind) -> list:
    """``X | None`` and ``Annotated[X, ...]`` seen as what they can hold: [X, NoneType], [X]."""
    origin = typing.get_origin(kind)
    if origin is typing.Annotated:
        return union_members(typing.get_args(kind)[0])
    if origin in (typing.Union, types.UnionType):
        return [member for arg in typing.get_args(kind) for member in union_members(arg)]
    return [kind]


def walk(kind, part: str | int) -> list:
    """The type one step down ``kind``: a model's field (``part`` a name) or a list's item (an index)."""
    if isinstance(part, int) and typing.get_origin(kind) is list:
        return list(typing.get_args(kind)[:1])
    if isinstance(part, str) and isinstance(kind, type) and issubclass(kind, BaseModel) and part in kind.model_fields:
        return [kind.model_fields[part].annotation]
    return []


def field_path(loc: typing.Sequence[str | int]) -> list[str]:
    """The fields and indexes of an error's ``loc`` up to the first union member pydantic names
    ("float", "list[str]"), or a key that is no field (logit_bias' "50256")."""
    path = []
    for part in loc:
        if isinstance(part, str) and (part in UNION_TAGS or not FIELD_NAME.fullmatch(part)):
            break
        path.append(str(part))
    return path


def wrong_shape(path: list[str], first: dict, errors: list[dict]) -> str:
    """The 400 for the field at ``path`` that takes several shapes (``FIELD_SHAPES``) and matched
    none: the shapes it takes, and what was wrong, said by the member that got furthest (about an
    item inside a list), or else the kind of JSON value that was sent."""
    field = first["loc"][: len(path) + 1]  # ("body", *path)
    mine = [error for error in errors if error["loc"][: len(field)] == field]
    deepest = max(mine, key=lambda error: len(error["loc"]))
    message = f"{'.'.join(path)} must be {FIELD_SHAPES[path[-1]]}"
    if len(deepest["loc"]) <= len(field) + 1:  # no member got past the value itself
        return f"{message}, got {json_kind(first.get('input'))}"
    inside = ".".join(path + [str(part) for part in deepest["loc"][len(field) + 1 :]])  # past the member's tag
    return f"{message}; {inside}: {deepest['msg']} (got {deepest.get('input')!r:.80})"


def json_kind(value) -> str:
    """What a JSON value is, in words: "null", "true", "a number (5)", "an object", ..."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"a number ({value!r:.40})"
    if isinstance(value, str):
        return f"a string ({value!r:.40})"
    return "a list" if isinstance(value, list) else "an object"


def json_bytes(content) -> bytes:
    """JSON that always renders: a string no UTF-8 can hold (a lone surrogate in an echoed value)
    is written as its \\u escape instead of failing the whole answer."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


class OpenAIJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return json_bytes(content)


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param=None,
    code=None,
    headers: dict[str, str] | None = None,
) -> OpenAIJSONResponse:
    return OpenAIJSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer, in OpenAI's shape, what FastAPI and Starlette refuse and what raises anywhere."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        # FastAPI says 422 with its own body; OpenAI clients expect 400 and OpenAI's error body.
        errors = exc.errors()
        # A list past its cap says so whatever else is wrong (in a union, beside "not a string")
        first = next((error for error in errors if error["type"] == "too_long"), errors[0])
        loc = field_path(first.get("loc", ())[1:])  # loc[0] is "body"
        if first.get("type") == "json_invalid":  # FastAPI puts the character the parser stopped at in loc
            position = first.get("loc", ())[1:]
            at = f" at character {position[0]}" if position and isinstance(position[0], int) else ""
            why = first.get("ctx", {}).get("error", first["msg"])
            return error_response(400, f"the request body is not valid JSON{at}: {why}")
        if not first.get("loc", ())[1:] and first.get("type") in ("model_attributes_type", "dict_type"):
            # the body parsed, but to something other than an object: a list, a number, or (sent
            # without the JSON content type) a string FastAPI never parsed
            sent_as = request.headers.get("content-type", "no Content-Type")
            how = "" if "json" in sent_as.lower() else f"; it was sent as {sent_as!r}"
            return error_response(
                400, f"the request body must be a JSON object sent with Content-Type: application/json{how}"
            )
        if first.get("loc") == ("body",) and first.get("type") == "missing":
            return error_response(
                400, "the request body is empty; send a JSON object with Content-Type: application/json"
            )
        where = ".".join(loc) or "body"
        if first["type"] == "too_long":
            items = "entries" if first["ctx"]["field_type"] == "Dictionary" else "items"
            got = first["ctx"].get("actual_length")  # (None for a dict, whose size is checked after its items)
            return error_response(
                400,
                f"{where} may hold at most {first['ctx']['max_length']} {items}, got {got or 'more'}",
                param=where,
            )
        if loc and loc[-1] in FIELD_SHAPES and len(first["loc"]) > len(loc) + 1:  # the members of a union all failed
            return error_response(400, wrong_shape(loc, first, errors), param=where)
        body_model = getattr(exc, "model", None)  # the route's model (body_reader.py's BodyError)
        if first.get("type") == "extra_forbidden" and body_model is not None:
            # pydantic says only "Extra inputs are not permitted": name what the object may hold
            # (a misspelt "temprature" is then plain to see)
            allowed = fields_at(body_model, first["loc"][1:-1])
            if allowed:
                unknown = ".".join(map(str, first["loc"][1:]))[:200]  # the key as sent, whatever its characters
                close = difflib.get_close_matches(str(first["loc"][-1])[:100], allowed, n=1)
                guess = f" (did you mean {close[0]}?)" if close else ""
                return error_response(
                    400,
                    f"{unknown}: unknown field{guess}; the fields allowed here are {', '.join(allowed)}",
                    param=unknown,
                )
        message = f"{where}: {first['msg']}" + (f" (got {first['input']!r:.80})" if "input" in first and loc else "")
        return error_response(400, message, param=where if loc else None)

    @app.exception_handler(InvalidRequest)
    async def on_invalid_request(request: Request, exc: InvalidRequest):
        return OpenAIJSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        detail, headers = str(exc.detail), exc.headers
        path = f"{request.url.path:.200}"
        if exc.status_code == 405 and headers and "Allow" in headers:  # Starlette names the methods in Allow
            detail = f"{request.method} {path}: this path takes {headers['Allow']}"
        elif exc.status_code == 404 and detail == "Not Found":
            detail = (
                f"there is no {path} on this server; its API is POST /v1/chat/completions, POST /v1/completions and "
                "GET /v1/models (and GET /health)"
            )
        return error_response(
            exc.status_code,
            detail,
            "invalid_request_error" if exc.status_code < 500 else "server_error",
            headers=headers,
        )

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        # uvicorn logs the traceback ("Exception in ASGI application"); the server goes on
        return error_response(500, f"internal error: {describe_error(exc)}", "server_error")
