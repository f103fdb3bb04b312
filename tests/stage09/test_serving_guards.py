"""Stage 9 (graded): the guards of a server that hostile, slow or too many clients cannot take
down. Most run on a tiny server with every guard set tight (serving_helpers.GUARD_LIMITS): an API key,
a 64 KiB body cap, two running requests and one queued, 2 s to send headers or a body, 1 s of
keep-alive, 3 s per request, a 1 s health timeout, 16 connections."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests
from openai import AuthenticationError, OpenAI

from serving_helpers import (
    CROWDED_CONNECTIONS,
    GUARD_KEY,
    GUARD_LIMITS,
    TINY_FAMILY,
    assert_nothing_leaked,
    assert_openai_error,
    post,
    wait_idle,
)

COMPLETIONS = "/v1/completions"
GOOD = {"model": TINY_FAMILY, "prompt": "Hi", "max_tokens": 3, "temperature": 0}


def in_background(send) -> tuple[threading.Thread, list]:
    """Run ``send()`` in a thread; its answer (or exception) lands in the list."""
    out: list = []

    def run():
        try:
            out.append(send())
        except Exception as error:  # noqa: BLE001 - kept for the assertion that reads it
            out.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_the_body_is_capped_before_it_is_parsed(guarded_server):
    cap = GUARD_LIMITS["max_request_bytes"]
    big = {**GOOD, "prompt": "x" * cap}
    error = assert_openai_error(post(guarded_server, COMPLETIONS, big), 413, f"a body over the {cap}-byte cap")
    assert "larger than" in error["message"], f"the 413 should say the body is too large: {error}"

    def chunks():  # no Content-Length: the cap must hold while the body streams in
        yield b'{"model": "llama", "prompt": "'
        for _ in range(cap // 1000 + 2):
            yield b"x" * 1000
        yield b'"}'

    assert_openai_error(
        post(guarded_server, COMPLETIONS, data=chunks()), 413, "a chunked body over the cap (no Content-Length)"
    )
    under = post(guarded_server, COMPLETIONS, {**GOOD, "prompt": "y" * (cap // 2)})
    assert under.status_code != 413, f"a body under the cap must not get 413: {under.text[:200]}"
    assert post(guarded_server, COMPLETIONS, GOOD).status_code == 200, "after bodies over the cap a good request failed"


def test_an_api_key_is_required(guarded_server):
    url = guarded_server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": GUARD_KEY}):
        error = assert_openai_error(
            requests.post(url + COMPLETIONS, json=GOOD, headers=headers, timeout=30),
            401,
            f"a request with headers {headers}",
        )
        assert error["code"] == "invalid_api_key", f"OpenAI's code for a bad key is 'invalid_api_key': {error}"
    assert_openai_error(requests.get(url + "/debug/state", timeout=30), 401, "/debug/state without the key")
    assert_openai_error(requests.get(url + "/metrics", timeout=30), 401, "/metrics without the key")
    assert guarded_server.get("/metrics").status_code == 200, "/metrics with the key must answer"
    assert requests.get(url + "/health", timeout=30).status_code == 200, (
        "/health must answer without a key (load balancers)"
    )
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(**GOOD)
    answer = OpenAI(base_url=url + "/v1", api_key=GUARD_KEY, max_retries=0).completions.create(**GOOD)
    assert answer.usage.completion_tokens == 3, f"with the right key the openai client must be served: {answer}"


def test_overload_is_answered_503_with_retry_after(guarded_server):
    server = guarded_server
    in_flight = GUARD_LIMITS["max_running_requests"] + GUARD_LIMITS["max_queued_requests"]
    server.arm_fault("scheduler", "stall", 3)  # the next step takes 3 s: requests pile up
    waiting = [in_background(lambda: post(server, COMPLETIONS, GOOD)) for _ in range(in_flight)]
    # /health counts them once the stall outlasts its 1 s timeout (it does not ask the stuck scheduler)
    deadline = time.monotonic() + 3
    while f"{in_flight} request(s) are in flight" not in server.health().text and time.monotonic() < deadline:
        time.sleep(0.05)
    answer = post(server, COMPLETIONS, GOOD)
    what = f"a request beyond the {in_flight} the server accepts at once"
    error = assert_openai_error(answer, 503, what)
    assert answer.headers.get("Retry-After", "").isdigit(), (
        f"{what}: a 503 must say when to retry (Retry-After): {answer.headers}"
    )
    assert "overloaded" in error["message"], f"{what}: the message should say the server is overloaded: {error}"
    for thread, _ in waiting:
        thread.join(30)
    assert_nothing_leaked(wait_idle(server, what), what)
    assert post(server, COMPLETIONS, GOOD).status_code == 200, "once the load is gone, a request must be served again"


def test_slow_clients_are_cut_off(guarded_server):
    served = post(guarded_server, COMPLETIONS, GOOD)
    assert served.status_code == 200, f"the server must serve a good request first: {served.text[:300]}"
    limit = GUARD_LIMITS["read_timeout"]
    host, port = "127.0.0.1", guarded_server.process.port
    with socket.create_connection((host, port)) as sock:  # half a request head, then nothing
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(limit + 10)
        start = time.monotonic()
        assert sock.recv(1000) == b"", "a connection whose headers never finish must be closed"
        assert time.monotonic() - start < limit + 5, f"it must be closed within the read timeout ({limit} s)"
    with socket.create_connection((host, port)) as sock:  # headers, then one byte of a 100-byte body
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GUARD_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
        )
        sock.settimeout(limit + 10)
        head = sock.recv(1000)
        assert head.startswith(b"HTTP/1.1 408"), (
            f"a body that stops arriving must get 408 after {limit} s; got {head[:100]!r}"
        )
    idle = GUARD_LIMITS["keep_alive_timeout"]
    with socket.create_connection((host, port)) as sock:  # one request answered, then the connection idles
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(idle + 10)
        answer, piece = b"", b"start"
        while piece and not answer.endswith(b'{"status":"ok"}'):  # the head, then the body
            piece = sock.recv(1000)
            answer += piece
        assert answer.startswith(b"HTTP/1.1 200"), (
            f"a kept-alive connection should get its answer; got {answer[:100]!r}"
        )
        start = time.monotonic()
        assert sock.recv(1000) == b"" and time.monotonic() - start < idle + 5, (
            f"an idle kept-alive connection must be closed after the keep-alive timeout ({idle} s)"
        )


def test_connections_beyond_the_limit_get_503(guarded_server):
    limit = GUARD_LIMITS["max_connections"]
    idle = [socket.create_connection(("127.0.0.1", guarded_server.process.port)) for _ in range(limit)]
    try:
        answer = requests.get(guarded_server.base_url + "/health", timeout=30)
        error = assert_openai_error(answer, 503, f"a request beyond {limit} open connections (--max-connections)")
        assert error["code"] == "server_overloaded" and answer.headers.get("Retry-After"), (
            f"a request beyond the connection limit is told to retry (code server_overloaded, Retry-After); got "
            f"{error}, headers {dict(answer.headers)}"
        )
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while guarded_server.health().status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert guarded_server.health().status_code == 200, "once the connections closed, the server must answer again"


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1000) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_stalled_connections_make_room_near_the_limit(crowded_server):
    """One client holding every connection with half-sent heads (slowloris) must not turn the
    others away for the whole read timeout: near --max-connections, a new connection closes
    those whose client has sent nothing for over SHED_AFTER_S."""
    from s09_zmq_serving.http_server import SHED_AFTER_S

    port = crowded_server.process.port
    stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(CROWDED_CONNECTIONS)]
    try:
        for sock in stalled:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(SHED_AFTER_S + 1)
        answer = post(crowded_server, COMPLETIONS, GOOD, timeout=30)
        assert answer.status_code == 200, (
            f"with {CROWDED_CONNECTIONS} connections stalled for over {SHED_AFTER_S} s on half a request head, a "
            f"new client must be served (the stalled ones closed to make room); got {answer.status_code} "
            f"{answer.text[:200]}"
        )
        closed = sum(map(closed_by_server, stalled))
        assert closed == CROWDED_CONNECTIONS, f"only {closed} of the {CROWDED_CONNECTIONS} stalled connections closed"
    finally:
        for sock in stalled:
            sock.close()


def test_health_says_503_while_the_scheduler_is_stuck(guarded_server):
    server = guarded_server
    stall = 3 * GUARD_LIMITS["health_timeout"]
    server.arm_fault("scheduler", "stall", stall)
    thread, _ = in_background(lambda: post(server, COMPLETIONS, GOOD))  # in flight while the scheduler is stuck
    deadline, answer = time.monotonic() + stall, None
    while time.monotonic() < deadline:
        answer = server.health()
        if answer.status_code == 503:
            break
        time.sleep(0.1)
    error = assert_openai_error(answer, 503, f"/health while the scheduler is stuck in a step for {stall} s")
    assert "scheduler" in error["message"], f"/health should name the stuck process: {error}"
    thread.join(30)
    assert_nothing_leaked(wait_idle(server, "a stuck step"), "a stuck step")
    assert server.health().status_code == 200, (
        f"once the step is over /health must say ok: {server.health().text[:200]}"
    )


def test_metrics_during_a_stall_name_the_stuck_process(guarded_server):
    """/metrics asks the scheduler through the tokenizer; while the tokenizer is stuck, its 503 must
    not blame the scheduler alone."""
    from s09_zmq_serving.api_server import METRICS_TIMEOUT_S

    server = guarded_server
    server.arm_fault("tokenizer", "stall", METRICS_TIMEOUT_S + 2)
    thread, _ = in_background(lambda: post(server, COMPLETIONS, GOOD))  # the request the tokenizer stalls on
    time.sleep(0.5)
    error = assert_openai_error(
        server.get("/metrics"), 503, f"/metrics while the tokenizer is stuck for longer than {METRICS_TIMEOUT_S} s"
    )
    assert "the tokenizer has not come round its loop" in error["message"], (
        f"the 503 should name the stuck tokenizer: {error}"
    )
    thread.join(30)
    assert_nothing_leaked(wait_idle(server, "a stalled tokenizer"), "a stalled tokenizer")


def test_a_request_past_its_timeout_is_aborted_and_its_kv_freed(guarded_server):
    server = guarded_server
    limit = GUARD_LIMITS["request_timeout"]
    long = {**GOOD, "max_tokens": 1000, "ignore_eos": True}
    server.arm_fault("scheduler", "stall", limit + 1)  # its first step alone outlasts the limit
    start = time.monotonic()
    error = assert_openai_error(post(server, COMPLETIONS, long), 504, f"a request past --request-timeout {limit}")
    assert time.monotonic() - start < limit + 2 and "request-timeout" in error["message"], (
        f"the 504 must come at the limit and say why: {error}"
    )
    state = wait_idle(server, "a request aborted at its timeout")
    assert state["steps"] < 1000, f"the timed-out request ran on ({state['steps']} steps) instead of being aborted"
    assert_nothing_leaked(state, "a request aborted at its timeout")


def test_a_body_of_a_million_bad_items_does_not_stall_the_server(tiny_server):
    """A million list items that are not messages: pydantic's report on each, turned into a list
    on the API server's event loop, held every client (/health too) for over 10 s. The list stops
    at its first bad item (protocol.capped), so the 400 comes at once."""
    body = '{"model": "llama", "messages": [' + ",".join(["1"] * 1_000_000) + "]}"
    thread, out = in_background(lambda: post(tiny_server, "/v1/chat/completions", data=body))
    slowest = 0.0
    while thread.is_alive():
        start = time.monotonic()
        tiny_server.health()
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.02)
    error = assert_openai_error(out[0], 400, "a body of a million messages that are not objects")
    assert error["param"] == "messages.0", f"the 400 should name the first bad item: {error}"
    assert slowest < 2, f"/health took {slowest:.1f} s to answer while the server read the bad body"


def test_a_message_name_is_used_or_refused(tiny_server, default_server):
    """The tiny server's chat template prints a message's name; the default model's does not, so
    there a name would be dropped without a word: it is refused instead."""
    plain = {"model": TINY_FAMILY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    named = {**plain, "messages": [{"role": "user", "content": "Hi", "name": "ada"}]}
    counts = [
        post(tiny_server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"] for body in (plain, named)
    ]
    assert counts[1] == counts[0] + len(" ada"), (
        f"a template that prints the name must get it: the prompt should grow by ' ada' (4 tokens); prompt_tokens "
        f"without and with the name: {counts}"
    )
    body = {**named, "model": default_server.model.name}
    error = assert_openai_error(post(default_server, "/v1/chat/completions", body), 400, "a name the template drops")
    assert error["param"] == "messages.0.name" and "name" in error["message"], f"the 400 should name the field: {error}"
