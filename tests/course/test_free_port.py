"""The servers' and tensor-parallel groups' ports come from below the kernel's ephemeral range, so
no socket the kernel numbers on its own (a server's own workers, gloo, ZMQ) can take one between
its choice and its bind (a tp=2 server's API once lost its port that way in a test run)."""

from __future__ import annotations

import socket

from s09_zmq_serving import server_process
from s09_zmq_serving.server_process import free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    low = (
        int(server_process.EPHEMERAL_PORTS.read_text().split()[0]) if server_process.EPHEMERAL_PORTS.exists() else 32768
    )
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), f"ports {sorted(ports)} should lie in [1024, {low})"
    for port in list(ports)[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: a server can take it


def test_a_port_in_use_is_never_chosen(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    monkeypatch.setattr(server_process.random, "sample", lambda candidates, k: [port])
    try:
        assert free_port() != port, "a port something holds must be skipped (the kernel's choice is the fallback)"
    finally:
        taken.close()
