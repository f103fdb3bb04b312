"""Stage 9 (graded): clients that go away have their requests aborted and their KV freed (the
scheduler's and the radix tree's invariants hold afterwards), and stopping the server leaves no
process behind."""

from __future__ import annotations

import signal
import time

import pytest
import requests

from conftest import TINY_ARGS, TINY_FAMILY
from serving_helpers import Server, post, read_sse, wait_gone


def wait_idle(server, what: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = server.debug_state()
        if state["running"] == state["waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert state["running"] == state["waiting"] == 0, (
        f"{what}: {timeout:.0f} s later the scheduler still has {state['running']} running and {state['waiting']} waiting "
        "requests: the requests of clients that went away were not aborted"
    )
    return state


def assert_nothing_leaked(state: dict, what: str) -> None:
    assert state["invariants"] == "ok", f"{what}: the scheduler's / radix tree's invariants are broken:\n{state['invariants']}"
    assert state["tracked_requests"] == 0, f"{what}: the scheduler process still tracks {state['tracked_requests']} requests"
    assert state["tree_locked_tokens"] == 0, f"{what}: {state['tree_locked_tokens']} cached tokens are still locked by nobody"
    held = state["pool_size"] - state["free_slots"]
    assert held == state["tree_cached_tokens"], (
        f"{what}: nothing runs, yet {held} KV slots are taken while the radix tree holds {state['tree_cached_tokens']}: "
        "an aborted request did not free its KV"
    )


def test_clients_that_disconnect_are_aborted_and_their_kv_freed(default_server):
    # The default model, not the tiny one: a tiny model's step takes about a millisecond, so its
    # requests would be over before the test could tell an abort from a finish.
    server = default_server
    what = "6 streaming clients (max_tokens 600) closed after their first chunks, and a non-streaming one that timed out"
    before = server.debug_state()["steps"]
    body = {"model": server.model.name, "prompt": "Tell me everything.", "max_tokens": 600, "temperature": 0, "stream": True,
            "ignore_eos": True}
    streams = []
    for i in range(6):
        answer = requests.post(server.base_url + "/v1/completions", json={**body, "prompt": f"{i}: tell me everything"},
                               stream=True, timeout=60)
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
        f"{what}: the engine ran {state['steps'] - before} steps; the requests ran on (toward their 600 tokens) instead of "
        "being aborted when their clients went away"
    )
    assert_nothing_leaked(state, what)
    answer = post(server, "/v1/completions", {**body, "max_tokens": 3})
    assert answer.status_code == 200 and read_sse(answer), f"after the disconnects a good request failed: {answer.text[:300]}"
    assert_nothing_leaked(wait_idle(server, what + ", then one good request"), what + ", then one good request")


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "kill -9 of the launcher"])
def test_stopping_the_server_leaves_no_process(tiny_models_root, tmp_path, how):
    server = Server(tiny_models_root / TINY_FAMILY, TINY_ARGS, tmp_path, new_session=True)
    pids = {}
    try:
        pids = server.debug_state()["pids"]
        assert len(pids) == 4, f"/debug/state should list the pids of the API server and its three workers; got {pids}"
        requests.post(server.base_url + "/v1/completions", json={"model": TINY_FAMILY, "prompt": "x", "max_tokens": 3}, timeout=60)
    finally:
        if how == "SIGTERM":
            code = server.stop(signal.SIGTERM)
        elif how == "Ctrl-C":  # a terminal's Ctrl-C: SIGINT to the whole process group
            code = server.stop(signal.SIGINT, group=True)
        else:  # the launcher dies without cleaning up: its children must notice and exit on their own
            code = server.stop(signal.SIGKILL)
    alive = wait_gone(pids.values(), timeout=10)
    assert not alive, (
        f"after {how} the server exited (code {code}) but these processes still run 10 s later: "
        f"{ {name: pid for name, pid in pids.items() if pid in alive} }"
    )
    if how != "kill -9 of the launcher":
        assert code == 0, f"after {how} the server should exit cleanly (code 0), got code {code}:\n{server.why()}"
