"""Stage 9's tests do not wait on a server that stopped answering (tests/stage09/serving_helpers.py):
a test that waited in vain marks its server; the next one first sends a one-token request, and
if that gets no answer either, it and every later test on that server fail at once, saying why."""

from __future__ import annotations

import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
import requests
import urllib3

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stage09"))

import serving_helpers  # noqa: E402
from serving_helpers import Server, waited_in_vain  # noqa: E402


class Answers(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"choices": [{"text": "!"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def stand_in(base_url: str, log: Path) -> Server:
    """A Server with no process behind it: only what check_answering reads."""
    server = Server.__new__(Server)
    server.model, server.headers, server.base_url = Path("/models/llama"), {}, base_url
    server.unanswered, server.silent = "tests/stage09/test_x.py::test_first", None
    log.write_text("serving llama ...\nERROR the scheduler dropped it\n")
    server.log_path, server.log = log, open(log)  # noqa: SIM115 (closed below)
    return server


def test_a_server_that_answers_is_trusted_again(tmp_path):
    http = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    server = stand_in(f"http://127.0.0.1:{http.server_port}", tmp_path / "log")
    try:
        server.check_answering()
        assert server.unanswered is None, "a one-token request was answered: the server is trusted again"
        server.check_answering()  # and no request is sent now
    finally:
        http.shutdown()
        server.log.close()


def test_a_server_that_does_not_answer_fails_the_tests_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(serving_helpers, "CANARY_TIMEOUT_S", 0.5)
    silent = socket.socket()  # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    server = stand_in(f"http://127.0.0.1:{silent.getsockname()[1]}", tmp_path / "log")
    try:
        with pytest.raises(pytest.fail.Exception) as first:
            server.check_answering()
        message = str(first.value)
        assert message.startswith(
            "not run: the server on llama left a request of tests/stage09/test_x.py::test_first"
        ), message
        assert "no answer within 0.5 s" in message and "ERROR the scheduler dropped it" in message, message
        with pytest.raises(pytest.fail.Exception) as later:
            server.check_answering()
        assert str(later.value).startswith("not run: the server on llama does not answer (the first"), later.value
    finally:
        silent.close()
        server.log.close()


@pytest.mark.parametrize(
    "error, waited",
    [
        (requests.exceptions.ReadTimeout("read timed out"), True),
        (requests.exceptions.ConnectionError(urllib3.exceptions.ReadTimeoutError(None, "/", "timed out")), True),
        (openai.APITimeoutError(request=httpx.Request("POST", "http://127.0.0.1/v1/completions")), True),
        (pytest.fail.Exception("Timeout (>300.0s) from pytest-timeout."), True),
        (AssertionError("expected status 400, got 500"), False),
        (requests.exceptions.ConnectionError("connection refused"), False),
    ],
    ids=["read timeout", "timeout inside a stream", "openai timeout", "pytest-timeout", "an assertion", "refused"],
)
def test_what_counts_as_waiting_in_vain(error, waited):
    assert waited_in_vain(error) is waited
    try:
        raise AssertionError("wrapped") from error
    except AssertionError as wrapper:
        assert waited_in_vain(wrapper) is waited, "a cause is looked at too"
