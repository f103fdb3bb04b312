"""``RequestGuard``: what every HTTP request passes before any route sees it.

A server's first line of defence works on bytes, before anything parses JSON: a client without
the API key is turned away (401); a compressed body is refused (415: none is decompressed here);
a body is read whole, under a size cap (413, whether or not the client declared its length: a
declared length can lie) and within a time limit (408: a client that sends a byte a minute must
not hold a connection forever), and must be UTF-8 (400 naming the first byte that is not: JSON
between systems is UTF-8, RFC 8259, though Python's parser would also take UTF-16 and UTF-32).
Only then does the route run, reading the body from memory. Every refusal is OpenAI's JSON error
(``http_errors.py``).
"""

from __future__ import annotations

import asyncio
import secrets

from .http_errors import error_response


class RequestGuard:
    """ASGI middleware, before any route: the API key (401), no compressed body (415), then the
    body, read whole under a size cap (413, before anyone parses it, whether or not the client
    declared its length) and within ``read_timeout`` seconds (408), and UTF-8 (400). The route
    then gets the body from memory."""

    def __init__(self, app, max_bytes: int, read_timeout: float, api_key: str | None):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout
        self.api_key = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and (scope["path"].startswith(("/v1/", "/debug/")) or scope["path"] == "/metrics"):
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.api_key):
                return await error_response(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )(scope, receive, send)
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            return await error_response(400, f"Content-Length must be a number of bytes, got {declared[:40]!r}")(
                scope, receive, send
            )
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        # (a request without a body, a GET from a client that sends the header on every request,
        # has nothing compressed: it passes)
        if encoding not in (b"", b"identity") and (int(declared) or b"transfer-encoding" in headers):
            return await error_response(
                415,
                f"Content-Encoding {encoding[:40].decode('latin-1')!r} is not supported: send the body uncompressed",
            )(scope, receive, send)
        if int(declared) > self.max_bytes:
            return await self.too_large(scope, receive, send)
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + self.read_timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
                return await error_response(408, f"the request body did not arrive within {self.read_timeout:g} s")(
                    scope, receive, send
                )
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self.too_large(scope, receive, send)

        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            return await error_response(
                400,
                f"the request body is not valid UTF-8: byte 0x{body[bad.start]:02x} at offset {bad.start}; "
                "send JSON encoded as UTF-8 (non-ASCII text as it is, or as \\u escapes)",
            )(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # then what comes after the body: the client's disconnect

        await self.app(scope, replay, send)

    async def too_large(self, scope, receive, send) -> None:
        await error_response(
            413,
            f"the request body is larger than {self.max_bytes} bytes, the most this server takes (--max-request-bytes)",
            code="request_too_large",
        )(scope, receive, send)
