"""What every worker process shares: its heartbeat, and a loop in which no message can kill it.

A server process that dies takes every request in flight with it, so each worker handles its
messages one at a time, each inside its own ``try``: whatever one message raises is logged with
its traceback and answered to that message's request as an error (``ErrorOut``: 500, a fault of
the server, not of the request), and the loop takes the next message::

    while True:
        heartbeat.beat()                       "I came round my loop" (at least once a second)
        message = recv (waits at most a second)
        try:     handle(message)
        except:  log it; its request gets ErrorOut 500; go on

The tokenizer and the detokenizer run this loop; the scheduler's own loop (recv, step, send)
follows the same rules in ``scheduler_process.py``.

**Heartbeats.** Each worker writes the time of its last loop iteration into shared memory; the
API server reads them for ``/health``. A worker that has not come round for longer than
``--health-timeout`` while requests are in flight is stuck (a step that never returns, a prompt
that never finishes tokenizing), and ``/health`` says 503 so that whoever watches the server
(a load balancer, an orchestrator) can take it out of service.

**Injected faults** (``DebugFaultReq``, only with ``--enable-debug-endpoints``) make a process
raise or stall on its next request, so the tests can prove the guards above.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from .io_struct import DebugFaultReq, ErrorOut

logger = logging.getLogger(__name__)

WORKERS = ("tokenizer", "scheduler", "detokenizer")
IDLE_POLL_MS = 1000  # an idle worker still comes round (and beats) this often
INJECTED = "a fault injected by POST /debug/fault"


class Heartbeats:
    """One shared float per worker: ``time.monotonic()`` (system-wide on Linux and macOS) of its
    last loop iteration. Created by the launcher, handed to every process."""

    def __init__(self, ctx):
        self.times = ctx.RawArray("d", len(WORKERS))  # plain shared memory: one writer per slot
        now = time.monotonic()
        for i in range(len(WORKERS)):
            self.times[i] = now

    def beat(self, worker: str) -> None:
        self.times[WORKERS.index(worker)] = time.monotonic()

    def ages(self) -> dict[str, float]:
        """Seconds since each worker last came round its loop."""
        now = time.monotonic()
        return {name: now - self.times[i] for i, name in enumerate(WORKERS)}


class Fault:
    """A fault armed by ``DebugFaultReq``: fires once, on the next request the process handles."""

    def __init__(self):
        self.armed: DebugFaultReq | None = None

    def arm(self, request: DebugFaultReq, process: str) -> None:
        if request.process == process:
            self.armed = request

    def fire(self) -> None:
        """Raise or stall if armed (then disarm)."""
        fault, self.armed = self.armed, None
        if fault is None:
            return
        if fault.kind == "stall":
            logger.warning("stalling %.1f s (%s)", fault.seconds, INJECTED)
            time.sleep(fault.seconds)
        else:
            raise RuntimeError(INJECTED)


def serve_messages(
    name: str,
    recv: zmq.Socket,
    handle: Callable[[object], None],
    reply_error: Callable[[ErrorOut], None],
    heartbeats: Heartbeats,
) -> None:
    """The worker's loop, forever: receive one message, ``handle`` it; if that raises, log it and
    ``reply_error`` an ErrorOut 500 to the message's request (if it names one)."""
    while True:
        heartbeats.beat(name)
        if not recv.poll(IDLE_POLL_MS):
            continue
        message = None
        try:
            message = recv.recv_pyobj()
            handle(message)
        except Exception as error:
            rid = getattr(message, "rid", None)
            logger.exception(
                "%s failed on %s %s; the request gets an error, the process goes on",
                name,
                type(message).__name__,
                rid or "",
            )
            if isinstance(rid, str):
                reply_error(ErrorOut.internal(rid, error, f"the {name} failed on this request"))
