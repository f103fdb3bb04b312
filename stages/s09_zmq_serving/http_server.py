"""uvicorn, set up for clients that are slow, many or gone, and for a clean stop.

uvicorn's defaults trust the client: a connection that sends half a request line and then nothing
stays open forever, and any number of connections may be open at once. Here:

- ``--read-timeout``: a request's headers must arrive within this many seconds of the
  connection opening (or of the previous answer on a kept-alive connection), else the connection
  is closed (``HeaderDeadlineH11Protocol``; uvicorn has no such timeout). The body gets the same
  time again (``request_guard.RequestGuard``).
- ``--keep-alive-timeout``: an idle kept-alive connection is closed after this (uvicorn's 5 s).
- ``--max-connections``: open connections, and requests in progress, at most; a request beyond
  either gets a 503 in OpenAI's shape with Retry-After, and its connection is closed
  (``ConnectionLimit``, counted by the metrics like any answer; uvicorn's own ``limit_concurrency``
  answers plain text, before the app). It sits above the queue cap and below the usual limit of
  1024 open files.
- Stalled connections go first: once three quarters of ``--max-connections`` are open, each new
  connection closes those that have waited on their client for over ``SHED_AFTER_S`` (half a
  request head or body, or an idle kept-alive connection). Without this, one client holding
  hundreds of half-sent heads (slowloris) turned every other client away with 503 for the whole
  ``--read-timeout``, and again each time it reconnected. A client that sends its request at
  once is never stalled that long; one that does needs to reconnect only under pressure.
- A request head is bounded by h11 (kept as it is): it buffers at most 16 KiB of a head that has
  not arrived whole, so a head much over uvicorn's 64 KiB reads is refused with 400.
- On SIGTERM / Ctrl-C, ``on_exit`` runs first (the API server tells every request in flight that
  it was cut short), then uvicorn's graceful shutdown: no new connections, open ones closed once
  their answer is complete (at most 2 s).
"""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_errors import error_response
from .protocol import RETRY_AFTER_S

GRACEFUL_SHUTDOWN_S = 2  # open answers get this long to complete when the server stops
SHED_AT = 0.75  # of --max-connections open: stalled connections are closed to make room
SHED_AFTER_S = 2.0  # a connection is stalled when its client has sent nothing it needs for this long


class HeaderDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers, and stalled
    connections closed when the server nears its connection limit."""

    header_timeout = 30.0  # set per server by make_http_server
    max_connections = 512  # likewise

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()
        self.quiet_since = self.loop.time()  # when its client last sent bytes (or got its answer)
        if len(self.connections) >= SHED_AT * self.max_connections:
            self.shed_stalled()

    def data_received(self, data: bytes) -> None:
        self.quiet_since = self.loop.time()
        super().data_received(data)

    def stalled_for(self, now: float) -> float:
        """How long this connection has waited on its client for a request head or body (0 while
        the server is answering it)."""
        between_requests = self.cycle is None or self.cycle.response_complete
        if between_requests or self.conn.their_state is h11.SEND_BODY:
            return now - self.quiet_since
        return 0.0

    def shed_stalled(self) -> None:
        now = self.loop.time()
        stalled = [
            other
            for other in self.connections
            if isinstance(other, HeaderDeadlineH11Protocol) and other.stalled_for(now) > SHED_AFTER_S
        ]
        for other in stalled:
            other.transport.close()
        if stalled:
            self.logger.warning(
                "%d connections open (--max-connections %d): closed %d whose client sent nothing for over %g s",
                len(self.connections),
                self.max_connections,
                len(stalled),
                SHED_AFTER_S,
            )

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout, self._on_header_deadline)

    def _on_header_deadline(self) -> None:
        waiting_for_headers = self.cycle is None or self.cycle.response_complete
        if waiting_for_headers and not self.transport.is_closing():
            self.logger.info(
                "closing a connection whose request headers did not arrive within %g s", self.header_timeout
            )
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete and self._header_deadline is not None:
            self._header_deadline.cancel()  # a request's headers arrived: the body has its own deadline
            self._header_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.quiet_since = self.loop.time()  # a kept-alive connection's wait for its next request starts now
        if self._header_deadline is None and not self.transport.is_closing():
            self._arm_header_deadline()  # for the next request on this kept-alive connection

    def connection_lost(self, exc) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)


class ConnectionLimit:
    """ASGI middleware: a request that finds more than ``max_connections`` connections open, or
    requests in progress, gets a 503 with Retry-After, and its connection is closed. It counts
    uvicorn's own server state, which ``make_http_server`` puts in ``app.state.server_state``."""

    def __init__(self, app, max_connections: int):
        self.app, self.max_connections = app, max_connections

    async def __call__(self, scope, receive, send) -> None:
        state = getattr(scope["app"].state, "server_state", None) if scope["type"] == "http" else None
        # this request's own connection and task are among them
        if state is not None and max(len(state.connections), len(state.tasks)) > self.max_connections:
            return await error_response(
                503,
                f"the server has more than {self.max_connections} connections or requests open at once "
                f"(--max-connections); retry after {RETRY_AFTER_S} s",
                "server_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
            )(scope, receive, send)
        await self.app(scope, receive, send)


class HTTPServer(uvicorn.Server):
    """uvicorn's server, calling ``on_exit`` when SIGTERM or SIGINT arrives, before it stops."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.on_exit()
        super().handle_exit(sig, frame)


def make_http_server(app, server_args, on_exit) -> HTTPServer:
    """uvicorn for ``app`` (which holds a ``ConnectionLimit``: it gets the server's state here)."""
    limits = {"header_timeout": server_args.read_timeout, "max_connections": server_args.max_connections}
    protocol = type("H11Protocol", (HeaderDeadlineH11Protocol,), limits)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        http=protocol,
        timeout_keep_alive=server_args.keep_alive_timeout,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        log_config=None,  # uvicorn's loggers go through the server's logging setup (launch.py), one format
        log_level=server_args.log_level,
        access_log=server_args.log_level in ("info", "debug"),
    )
    server = HTTPServer(config, on_exit)
    app.state.server_state = server.server_state  # what ConnectionLimit counts
    return server
