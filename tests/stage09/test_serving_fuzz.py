"""Stage 9 (graded): hypothesis throws request bodies at one running server, good ones spoiled by
hostile changes (lone surrogates, NUL, template syntax, 2**63, 10**400, NaN, Infinity, wrong
types, unknown fields, missing fields) and bytes that are not JSON at all. Every answer must be a
well-formed OpenAI answer or OpenAI's error body, never a 5xx; afterwards the server is healthy,
its invariants hold and no KV slot leaked.

The bodies come from tools/soak_serving.py (the soak sends the same ones for minutes). The run is
derandomized, so a failure repeats; FUZZ_BUDGET_S bounds its time (default 20 s)."""

from __future__ import annotations

import os
import time

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving_helpers import TINY_FAMILY, assert_nothing_leaked, wait_idle
from soak_serving import answer_problems, hostile_request

BUDGET_S = float(os.environ.get("FUZZ_BUDGET_S", "20"))


def test_hostile_bodies_get_openai_answers_and_leave_the_server_whole(tiny_server):
    session = requests.Session()
    deadline = time.monotonic() + BUDGET_S
    sent: list[str] = []

    @settings(
        max_examples=1500,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(st.randoms(use_true_random=False))
    def one(rng):
        path, data, body = hostile_request(rng, TINY_FAMILY)  # drawn always: hypothesis replays examples
        if time.monotonic() > deadline:  # the budget is spent: the remaining examples pass unsent
            return
        answer = session.post(
            tiny_server.base_url + path, data=data, headers={"Content-Type": "application/json"}, timeout=60
        )
        sent.append(str(answer.status_code))
        problems = answer_problems(path, body, answer, {200, 400, 404, 413})
        assert not problems, f"POST {path} with the body {data[:400]!r} got a bad answer: {problems}"

    one()
    statuses = {status: sent.count(status) for status in sorted(set(sent))}
    assert len(sent) >= 50 and "200" in statuses and "400" in statuses, (
        f"the fuzz should have sent at least 50 bodies, some served and some refused, within {BUDGET_S:g} s; "
        f"statuses {statuses}"
    )
    assert tiny_server.health().status_code == 200, f"after the fuzz /health says {tiny_server.health().text[:300]}"
    assert_nothing_leaked(
        wait_idle(tiny_server, f"after {len(sent)} hostile bodies"), f"after {len(sent)} hostile bodies"
    )
