"""The server as a child process, for scripts that talk to it: the demo, the serving benchmark
and the notebook start it with ``ServerProcess``, wait until /health answers, and stop it."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; elsewhere assume the IANA-ish default


def free_port() -> int:
    """A port nothing listens on, chosen below the kernel's ephemeral range. Between this choice
    and the bind of whoever gets it, other sockets are opened (a server's own workers: ZMQ,
    torch.distributed's gloo), and every port the kernel hands out on its own (a bind to 0, a
    connect) comes from that range: a port below it cannot be taken first that way. (A port
    picked by binding 0 could: a tp=2 server's API once lost its port to its own ranks.)"""
    try:
        low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = range(max(1024, low - 10000), low)
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: try another
                continue
            return port
    with socket.socket() as s:  # (64 taken in a row: take the kernel's choice after all)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m s09_zmq_serving --port PORT *args`` in a child process (a context manager).

    Its output goes to ``log`` (a file object; None: this process's own stdout/stderr);
    ``new_session`` gives it its own process group (as a terminal would, for Ctrl-C tests). The
    implementation switch reaches it through the environment (tools/switch_site)."""

    def __init__(
        self, args: list[str], port: int | None = None, log=None, env: dict | None = None, new_session: bool = False
    ):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "s09_zmq_serving", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT if log else None, env=env, start_new_session=new_session
        )

    def get(self, path: str, timeout: float = 10) -> dict:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as answer:
            return json.loads(answer.read())

    def wait_ready(self, timeout: float = 300) -> None:
        """Until /health says ok; RuntimeError if the server exits or does not come up in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before it was ready")
            try:
                self.get("/health", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")

    def stop(self, sig: int = signal.SIGTERM, group: bool = False, timeout: float = 20) -> int:
        """Send ``sig`` (to its whole process group with ``group``, as a terminal's Ctrl-C does;
        needs ``new_session``), then wait (SIGKILL after ``timeout``); returns its exit code."""
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
