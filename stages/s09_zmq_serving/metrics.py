"""Prometheus metrics (``GET /metrics``, ``--enable-metrics``): what an operator graphs and alerts on.

A Prometheus server scrapes the endpoint every few seconds and keeps each number's history; a
dashboard then shows rates (``rate(engine:generation_tokens_total[1m])`` is tokens per second)
and latency percentiles (``histogram_quantile(0.99, ...)`` over a histogram's buckets). The
numbers come from two places, each measuring what only it can see:

- **Each request, as its client saw it** (this process, the API server): time to first token,
  the gap between tokens, the whole request, and how each engine request ended. ``EngineClient``
  reports every piece of an answer at the moment it arrives (``piece``) and every request that
  ends without its last piece (``end``: its client left, it ran out of time, a worker failed).
  ``HTTPRequestCounter`` counts every HTTP answer by route and status, the ones no engine request
  ever saw too: the guards' 401/408/413, validation's 400s, unknown paths' 404s.
- **The engine's state** (the scheduler process, asked at each scrape, between two of its steps
  as /debug/state is): requests running and queued, the share of KV slots requests hold, and what
  the forward passes computed (prefill tokens, tokens taken from the prefix cache, decode tokens).

The names follow SGLang's (``sglang:`` there, ``engine:`` here). The registry is this server's
own, not ``prometheus_client``'s global one: nothing is shared between two servers in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match, Router

from .http_errors import CLIENT_CLOSED_REQUEST

PREFIX = "engine:"
# Buckets wide enough for a laptop CPU (seconds per token) and a GPU (milliseconds).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class Timing:
    """One engine request in flight: when it reached its route, when its last token came, how many so far."""

    arrived: float
    last: float
    tokens: int = 0


class ServerMetrics:
    """The API server's metrics, and the scrape's answer (``render``)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, list(labels), registry=self.registry, buckets=buckets).labels(**labels)

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, list(labels), registry=self.registry).labels(**labels)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "From a request's arrival at its route (parsed and validated) to its first token; a grammar's "
            "compile, tokenizing and the queue included.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "The time between two tokens of one request (tokens that arrive together share the gap).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "From a request's arrival at its route to its last token (finished ones).",
            E2E_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of the requests that got a first token.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated and sent to clients.")
        self.finished = Counter(
            PREFIX + "requests_finished_total",
            "Engine requests (one per choice) by how they ended: stop, length, abort (the client left or "
            "the time ran out), error.",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            PREFIX + "http_requests_total",
            "HTTP requests by the route that served them ('other': a path this server does not serve) and the "
            f"status of the answer ({CLIENT_CLOSED_REQUEST}: the client left before an answer).",
            [*labels, "endpoint", "status"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.engine_state = EngineStateCollector(model_name)
        self.registry.register(self.engine_state)
        self.timings: dict[str, Timing] = {}  # rid -> its timing, while in flight

    def start(self, rids: list[str], arrived: float) -> None:
        """``rids`` were sent to the workers, for a request that reached its route at ``arrived``."""
        for rid in rids:
            self.timings[rid] = Timing(arrived, arrived)

    def piece(self, rid: str, prompt_tokens: int, tokens: int, finish_reason: str | None, now: float) -> None:
        """A piece of ``rid``'s answer arrived at ``now``; ``tokens``: every token it has so far."""
        timing = self.timings.get(rid)
        if timing is None:
            return
        new = tokens - timing.tokens
        if new > 0:
            if timing.tokens == 0:
                self.ttft.observe(now - timing.arrived)
                self.prompt_tokens.inc(prompt_tokens)
                new -= 1
                gap = 0.0  # tokens that came with the first one came at once
            else:
                gap = (now - timing.last) / new
            for _ in range(new):
                self.itl.observe(gap)
            self.generation_tokens.inc(tokens - timing.tokens)
            timing.tokens, timing.last = tokens, now
        if finish_reason is not None:
            self.e2e.observe(now - timing.arrived)
            self.end(rid, finish_reason)

    def end(self, rid: str, reason: str) -> None:
        """``rid`` ended (no-op if it already had): counted under ``reason``."""
        if self.timings.pop(rid, None) is not None:
            self.finished.labels(self.model_name, reason).inc()

    def render(self, engine_state: dict[str, Any]) -> bytes:
        """The scrape's answer, in Prometheus' text format, with the scheduler's ``engine_state``."""
        self.engine_state.state = engine_state  # set and read without an await between: one scrape's
        return generate_latest(self.registry)


class HTTPRequestCounter:
    """ASGI middleware, outside the guards: every HTTP answer counted by route and status
    (``engine:http_requests_total``), the refusals that never reach a route included.

    The label is the route's template (``/v1/models/{name:path}``), found before anything runs, so
    a 401 or 413 from the guards still names the route it was meant for; a path the app does not
    serve is ``other``. A label per path would let any client grow the registry without bound, one
    invented URL at a time. The status is the one the answer started with: a stream that ends in an
    error event is a 200 (its engine requests count as ``error`` in requests_finished_total)."""

    def __init__(self, app, metrics: ServerMetrics, router: Router):
        self.app, self.metrics, self.router = app, metrics, router

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = next(
            (route.path for route in self.router.routes if route.matches(scope)[0] is not Match.NONE), "other"
        )
        status = None

        async def noting(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting)
        except Exception:
            status = status or 500  # the error handler outside answers it with a 500
            raise
        finally:
            # no answer at all: the client left while its request was being read
            status = status or CLIENT_CLOSED_REQUEST
            self.metrics.http_requests.labels(self.metrics.model_name, endpoint, str(status)).inc()


class EngineStateCollector(Collector):
    """The scheduler's numbers, as of the scrape in progress: a custom collector, because they are
    read off another process (a Counter here could only add, never be set to the scheduler's count)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.state: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        state, labels = self.state, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        computed, cached = state["prefill_tokens"], state["cached_tokens"]
        yield gauge("num_running_reqs", "Requests that hold KV slots (being prefilled or decoded).", state["running"])
        yield gauge("num_queue_reqs", "Requests waiting to be admitted.", state["waiting"])
        yield gauge(
            "token_usage",
            "The share of the KV pool's slots that requests hold (slots only the prefix cache holds count "
            "as free: they are evicted when needed).",
            state["held_slots"] / state["pool_size"],
        )
        yield gauge("max_total_num_tokens", "The KV pool's size, in tokens.", state["pool_size"])
        yield gauge(
            "cache_hit_rate",
            "Of the prompt tokens prefills needed so far, the share the prefix cache held.",
            cached / (computed + cached) if computed + cached else 0.0,
        )
        yield counter("prefill_computed_tokens", "Tokens computed by prefill passes (recomputed ones too).", computed)
        yield counter("cached_tokens", "Prompt tokens taken from the prefix cache instead of computed.", cached)
        yield counter("decode_tokens", "Tokens computed by decode passes.", state["decode_tokens"])
        yield counter("forward_passes", "Forward passes (engine steps) run.", state["steps"])
        yield counter(
            "retractions", "Requests retracted to free KV slots (their tokens computed again).", state["retractions"]
        )
