"""Stage 9 (graded): GET /metrics (``--enable-metrics``) in Prometheus' text format. Its counts must
be the ones the clients got (usage, finish reasons, every HTTP answer's status), its latency
histograms must hold one sample per request (time to first token, end to end) and per later token
(inter-token), a request cut short counts as "abort" or "error", and once nothing runs the engine's
gauges say so. Each test reads the counters before and after its own requests: the server is shared
with other tests of this worker."""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from serving_helpers import TINY_FAMILY, Server, post, read_sse, wait_idle
from soak_serving import grown, metric_samples

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def scrape(server: Server) -> dict[str, float]:
    """Every sample of /metrics by name, parsed by prometheus_client's own parser (a malformed
    exposition fails here)."""
    answer = server.get("/metrics")
    assert answer.status_code == 200, f"GET /metrics answered {answer.status_code}: {answer.text[:300]}"
    assert answer.headers["content-type"].startswith("text/plain"), (
        f"Prometheus reads the text format (text/plain); /metrics said {answer.headers['content-type']}"
    )
    return metric_samples(answer.text)


def change(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def finished(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """How many engine requests ended, by reason, between the two scrapes."""
    return grown(before, after, "engine:requests_finished_total")


def test_metrics_count_what_the_clients_got(tiny_server):
    server = tiny_server
    wait_idle(server, "before the metrics test")
    before = scrape(server)
    prompt = "The metrics count every token of every answer."
    answers = [
        post(
            server,
            CHAT,
            {
                "model": TINY_FAMILY,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 5,
                "n": 2,
                "temperature": 1.0,
                "seed": 3,
            },
        ).json(),
        post(server, COMPLETIONS, {"model": TINY_FAMILY, "prompt": prompt, "max_tokens": 9, "ignore_eos": True}).json(),
        # the same prompt again: its tokens come from the radix tree this time
        post(server, COMPLETIONS, {"model": TINY_FAMILY, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}).json(),
    ]
    streamed = read_sse(
        post(
            server,
            COMPLETIONS,
            {
                "model": TINY_FAMILY,
                "prompt": "Streamed",
                "max_tokens": 6,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            stream=True,
        )
    )
    answers.append({"usage": streamed[-1]["usage"], "choices": [c for chunk in streamed for c in chunk["choices"]]})
    wait_idle(server, "after the metrics test's requests")
    after = scrape(server)

    reasons: dict[str, int] = {}
    choices = prompt_tokens = completion_tokens = 0
    for answer in answers:
        ended = [c["finish_reason"] for c in answer["choices"] if c.get("finish_reason")]
        for reason in ended:
            reasons[reason] = reasons.get(reason, 0) + 1
        choices += len(ended)
        prompt_tokens += answer["usage"]["prompt_tokens"] * len(ended)  # usage counts an n>1 prompt once
        completion_tokens += answer["usage"]["completion_tokens"]
    assert finished(before, after) == reasons, (
        f"engine:requests_finished_total must count each choice under its finish reason as the clients got it: "
        f"the clients got {reasons}, the counter grew by {finished(before, after)}"
    )
    assert change(before, after, "engine:generation_tokens_total") == completion_tokens, (
        "engine:generation_tokens_total must grow by the completion tokens the clients' usage counted "
        f"({completion_tokens}); it grew by {change(before, after, 'engine:generation_tokens_total')}"
    )
    assert change(before, after, "engine:prompt_tokens_total") == prompt_tokens, (
        f"engine:prompt_tokens_total must grow by each choice's prompt tokens ({prompt_tokens}); it grew by "
        f"{change(before, after, 'engine:prompt_tokens_total')}"
    )
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert change(before, after, f"engine:{name}_count") == choices, (
            f"engine:{name} must hold one sample per choice ({choices}); it got "
            f"{change(before, after, f'engine:{name}_count')}"
        )
    assert change(before, after, "engine:inter_token_latency_seconds_count") == completion_tokens - choices, (
        f"engine:inter_token_latency_seconds must hold one sample per token after each choice's first "
        f"({completion_tokens} - {choices}); it got {change(before, after, 'engine:inter_token_latency_seconds_count')}"
    )
    ttft = change(before, after, "engine:time_to_first_token_seconds_sum")
    e2e = change(before, after, "engine:e2e_request_latency_seconds_sum")
    assert 0 < ttft < e2e, f"the first tokens came before the last ones: TTFT sum {ttft} s, end-to-end sum {e2e} s"

    # The engine's side, asked of the scheduler at the scrape.
    assert after["engine:num_running_reqs"] == after["engine:num_queue_reqs"] == 0, (
        f"nothing runs, yet /metrics says {after['engine:num_running_reqs']} running and "
        f"{after['engine:num_queue_reqs']} queued"
    )
    assert after["engine:token_usage"] == 0, (
        f"nothing runs, so no request holds a KV slot (the radix tree's count as free); token_usage is "
        f"{after['engine:token_usage']}"
    )
    cached = change(before, after, "engine:cached_tokens_total")
    assert cached > 0, "the repeated prompt's tokens came from the radix tree: engine:cached_tokens_total must grow"
    assert change(before, after, "engine:prefill_computed_tokens_total") > 0
    assert change(before, after, "engine:decode_tokens_total") > 0
    # the 9-token completion alone took 9 passes (a prefill, then a decode for each later token)
    assert change(before, after, "engine:forward_passes_total") >= 9
    total = after["engine:cached_tokens_total"] + after["engine:prefill_computed_tokens_total"]
    assert after["engine:cache_hit_rate"] == pytest.approx(after["engine:cached_tokens_total"] / total), (
        "engine:cache_hit_rate is the cached share of the prompt tokens prefills needed"
    )


def test_requests_cut_short_are_counted_and_forgotten(tiny_server):
    server = tiny_server
    wait_idle(server, "before the test")
    before = scrape(server)
    stream = post(
        server,
        COMPLETIONS,
        {"model": TINY_FAMILY, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True},
        stream=True,
    )
    lines = stream.iter_lines(decode_unicode=True)
    assert any(line.startswith("data: {") for line in lines), "the stream should have begun"
    stream.close()  # the client leaves mid-answer
    # A prompt longer than the context: the scheduler refuses it (an error after the request was sent).
    too_long = post(server, COMPLETIONS, {"model": TINY_FAMILY, "prompt": "y" * 1100, "max_tokens": 1})
    assert too_long.status_code == 400, f"a prompt past the context is a 400: {too_long.text[:300]}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and finished(before, scrape(server)).get("abort", 0) < 1:
        time.sleep(0.1)
    state = wait_idle(server, "after a client left")
    after = scrape(server)
    assert finished(before, after) == {"abort": 1, "error": 1}, (
        "a choice whose client left counts as 'abort', one a worker refused as 'error'; the counter grew by "
        f"{finished(before, after)}"
    )
    assert state["timed_requests"] == 0, f"the metrics still time {state['timed_requests']} requests that ended"
    assert change(before, after, "engine:e2e_request_latency_seconds_count") == 0, (
        "end-to-end latency is of finished requests: one cut short adds no sample"
    )


def test_metrics_answer_while_requests_run(tiny_server):
    """A scrape between steps sees the running requests and the KV they hold."""
    server = tiny_server
    wait_idle(server, "before the test")
    streams = [
        post(
            server,
            COMPLETIONS,
            {"model": TINY_FAMILY, "prompt": f"run {i}", "max_tokens": 1000, "ignore_eos": True, "stream": True},
            stream=True,
        )
        for i in range(3)
    ]
    # (each stream's line iterator is kept: one dropped half-read closes its connection)
    readers = [stream.iter_lines(decode_unicode=True) for stream in streams]
    try:
        for reader in readers:
            assert next(line for line in reader if line).startswith("data: {"), "each stream should have begun"
        during = scrape(server)
    finally:
        for stream in streams:
            stream.close()
    assert during["engine:num_running_reqs"] == 3, (
        f"three streams were running at the scrape; engine:num_running_reqs said {during['engine:num_running_reqs']}"
    )
    assert 0 < during["engine:token_usage"] <= 1, (
        f"three running requests hold KV slots: token_usage must be above 0; it is {during['engine:token_usage']}"
    )
    wait_idle(server, "after three streams were closed")


def http_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """How many HTTP answers each (route, status) got between the two scrapes, /metrics' own left out."""
    counts = grown(before, after, "engine:http_requests_total")
    return {labels: n for labels, n in counts.items() if not labels.startswith("/metrics,")}


def test_every_http_answer_is_counted_by_route_and_status(guarded_server):
    """The guards' refusals (401, 413), validation's 400, a 405, a 404 from a route and from paths
    nobody serves, a fault's 500 and a client that left mid-body (499, no answer) are each counted
    once, under the route they were sent to; invented paths all count as "other"."""
    server = guarded_server
    wait_idle(server, "before the test")
    before = scrape(server)
    url = server.base_url + COMPLETIONS
    good = {"model": TINY_FAMILY, "prompt": "count me", "max_tokens": 1}
    statuses = [
        post(server, COMPLETIONS, good).status_code,
        post(server, COMPLETIONS, {**good, "max_tokens": -1}).status_code,
        requests.post(url, json=good, timeout=60).status_code,  # no API key
        post(server, COMPLETIONS, data=json.dumps({**good, "prompt": "x" * 70_000})).status_code,  # over 64 KiB
        server.get(COMPLETIONS).status_code,
        server.get("/v1/models/no-such-model").status_code,
    ]
    invented = [server.get(f"/nothing/{i}/\u00e9\U0001f600%00").status_code for i in range(12)]
    with pytest.raises(requests.HTTPError):  # a fault of the API server on this very request: a 500
        post(server, "/debug/fault", {"process": "api_server"}).raise_for_status()
    with socket.create_connection(("127.0.0.1", server.process.port)) as sock:  # half a body, then gone
        sock.sendall(
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: {server.headers['Authorization']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
        )
    assert statuses == [200, 400, 401, 413, 405, 404] and set(invented) == {404}, (
        f"the requests themselves should have been answered 200, 400, 401, 413, 405, 404 and 404s; got {statuses} "
        f"and {sorted(set(invented))}"
    )
    expected = {
        f"{COMPLETIONS},200": 1,
        f"{COMPLETIONS},400": 1,
        f"{COMPLETIONS},401": 1,
        f"{COMPLETIONS},413": 1,
        f"{COMPLETIONS},405": 1,
        f"{COMPLETIONS},499": 1,
        "/v1/models/{name:path},404": 1,
        "other,404": 12,
        "/debug/fault,500": 1,
    }
    deadline = time.monotonic() + 20  # the vanished client is counted once the server notices it left
    while time.monotonic() < deadline and http_counts(before, after := scrape(server)) != expected:
        time.sleep(0.2)
    assert http_counts(before, after) == expected, (
        "engine:http_requests_total must count each answer once under the route's template and the status the "
        "client got (499: it left before any answer; 'other': a path this server does not serve, so invented "
        f"URLs cannot grow the registry). Expected {expected}, counted {http_counts(before, after)}"
    )
    assert change(before, after, "engine:http_requests_total{/metrics,200}") >= 1, "the scrape counts itself"
