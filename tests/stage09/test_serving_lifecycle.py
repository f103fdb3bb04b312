"""Stage 9 (graded): clients that go away have their requests aborted and their KV freed (the
scheduler's and the radix tree's invariants hold afterwards), and stopping the server tells the
streams in flight that they were cut short and leaves no process behind."""

from __future__ import annotations

import json
import signal

import pytest
import requests

from serving_helpers import TINY_ARGS, TINY_FAMILY, Server, assert_nothing_leaked, post, read_sse, wait_gone, wait_idle


def test_clients_that_disconnect_are_aborted_and_their_kv_freed(default_server):
    # The default model, not the tiny one: a tiny model's step takes about a millisecond, so its
    # requests would be over before the test could tell an abort from a finish.
    server = default_server
    what = (
        "6 streaming clients (max_tokens 600) closed after their first chunks, and a non-streaming one that timed out"
    )
    before = server.debug_state()["steps"]
    body = {
        "model": server.model.name,
        "prompt": "Tell me everything.",
        "max_tokens": 600,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    streams = []
    for i in range(6):
        answer = requests.post(
            server.base_url + "/v1/completions",
            json={**body, "prompt": f"{i}: tell me everything"},
            stream=True,
            timeout=60,
        )
        assert answer.status_code == 200, f"a streaming request got {answer.status_code}: {answer.text[:200]}"
        lines = answer.iter_lines()
        next(line for line in lines if line)  # its first chunk arrived: it is running
        streams.append(answer)
    with pytest.raises(requests.exceptions.ReadTimeout):  # this client gives up after 0.3 s
        requests.post(server.base_url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    for answer in streams:
        answer.close()  # the client goes away
    state = wait_idle(server, what)
    # Each request needed 600 steps to finish; aborted, they stop within a few steps of their client leaving.
    assert state["steps"] - before < 200, (
        f"{what}: the engine ran {state['steps'] - before} steps; the requests ran on (toward their 600 tokens) "
        "instead of "
        "being aborted when their clients went away"
    )
    assert_nothing_leaked(state, what)
    answer = post(server, "/v1/completions", {**body, "max_tokens": 3})
    assert answer.status_code == 200 and read_sse(answer), (
        f"after the disconnects a good request failed: {answer.text[:300]}"
    )
    assert_nothing_leaked(wait_idle(server, what + ", then one good request"), what + ", then one good request")


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "kill -9 of the launcher"])
def test_stopping_the_server_ends_streams_and_leaves_no_process(tiny_server, tiny_models_root, tmp_path, how):
    # tiny_server first: a server that cannot even start (an unwritten stage) fails here at once,
    # instead of being started three more times to fail the same way.
    # Started as `make serve` starts it: no debug endpoints, no metrics (they are off by default).
    server = Server(tiny_models_root / TINY_FAMILY, TINY_ARGS, tmp_path, new_session=True, debug=False, metrics=False)
    pids, events = {}, []
    try:
        pids = server.pids()
        assert len(pids) == 4, (
            f"the startup line should list the pids of the API server and its three workers; got {pids}"
        )
        for path in ("/debug/state", "/debug/fault", "/metrics"):
            answer = requests.request("POST" if path == "/debug/fault" else "GET", server.base_url + path, timeout=30)
            flag = "--enable-metrics" if path == "/metrics" else "--enable-debug-endpoints"
            assert answer.status_code == 404, (
                f"{path} answered {answer.status_code} on a server started without {flag}: it must be off by default"
            )
        # A stream in flight when the signal comes (1000 tokens: it runs for seconds).
        stream = requests.post(
            server.base_url + "/v1/completions",
            stream=True,
            timeout=60,
            json={"model": TINY_FAMILY, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True},
        )
        assert stream.status_code == 200, f"a streamed request got {stream.status_code}: {stream.text[:300]}"
        lines = stream.iter_lines(decode_unicode=True)
        events.append(next(line for line in lines if line))
        assert "choices" in events[0], f"the stream should have begun with a chunk of text; it sent {events[0][:300]}"
    finally:
        if how == "SIGTERM":
            code = server.stop(signal.SIGTERM)
        elif how == "Ctrl-C":  # a terminal's Ctrl-C: SIGINT to the whole process group
            code = server.stop(signal.SIGINT, group=True)
        else:  # the launcher dies without cleaning up: its children must notice and exit on their own
            code = server.stop(signal.SIGKILL)
    if how != "kill -9 of the launcher":
        try:
            events += [line for line in lines if line]
        except requests.exceptions.RequestException as error:
            pytest.fail(
                f"after {how} the stream in flight broke off ({type(error).__name__}) instead of ending properly "
                f"with an error event and data: [DONE]; it had sent {events[-2:]}"
            )
        assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][len("data: ") :]), (
            f"after {how} the stream in flight must get a last event with OpenAI's error body, then data: [DONE], so "
            f"that its client knows it was cut short; its last events were {events[-2:]}"
        )
        assert "shutting down" in events[-2], (
            f"the stream's last error should say the server is shutting down: {events[-2]}"
        )
    alive = wait_gone(pids.values(), timeout=10)
    assert not alive, (
        f"after {how} the server exited (code {code}) but these processes still run 10 s later: "
        f"{ {name: pid for name, pid in pids.items() if pid in alive} }"
    )
    if how != "kill -9 of the launcher":
        assert code == 0, f"after {how} the server should exit cleanly (code 0), got code {code}:\n{server.why()}"
