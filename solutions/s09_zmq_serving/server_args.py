"""``ServerArgs``: everything ``python -m s09_zmq_serving`` is told, and the engine's knobs.

The engine's knobs are a table: each row is a command-line flag that becomes one keyword of
``Engine(...)``. A later stage's engine with a new knob (chunked_prefill_size, a CUDA-graph
switch) needs one more row here and nothing else.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# (flag, Engine keyword, type, help). A flag left out leaves the engine's own default.
# Type "disable": the flag sets the keyword to False; "flag": the flag sets it to True.
ENGINE_KNOBS: list[tuple[str, str, Any, str]] = [
    ("--pool-size", "pool_size", int, "KV slots (default: the engine's default)"),
    ("--page-size", "page_size", int, "tokens per KV page"),
    ("--max-running-requests", "max_running_requests", int, "most requests in one forward pass"),
    ("--max-prefill-tokens", "max_prefill_tokens", int, "prompt tokens admitted per step"),
    ("--new-token-ratio", "new_token_ratio", float, "share of max_new_tokens admission keeps free"),
    ("--attention-backend", "attention_backend", str, "auto, torch or flash"),
    ("--schedule-policy", "schedule_policy", str, "lpm or fcfs"),
    ("--disable-radix-cache", "enable_radix_cache", "disable", "compute every prompt in full"),
    (
        "--chunked-prefill-size",
        "chunked_prefill_size",
        int,
        "prompt tokens per step; longer prompts are chunked (stage 7; default 512: a server streams)",
    ),
    ("--cuda-graph-max-bs", "cuda_graph_max_bs", int, "largest decode batch replayed from a CUDA graph (stage 8)"),
    (
        "--cuda-graph-max-kv-len",
        "cuda_graph_max_kv_len",
        int,
        "longest sequence a CUDA graph decodes; longer ones run eagerly (stage 8)",
    ),
    (
        "--disable-cuda-graph",
        "disable_cuda_graph",
        "flag",
        "run every decode eagerly (stage 8; by default graphs run on CUDA only)",
    ),
    (
        "--disable-overlap",
        "disable_overlap",
        "flag",
        "serve stage 8's engine: each step scheduled after its forward, not during it (default: stage 11's engine; "
        "with --tp-size, stage 12's without overlap)",
    ),
    (
        "--enable-overlap",
        "disable_overlap",
        "disable",
        "overlap scheduling always (stage 10; default: with CUDA, or when torch's threads leave a CPU core free)",
    ),
    ("--tp-size", "tp_size", int, "tensor-parallel ranks (stage 12; default 1: one process)"),
    (
        "--torch-threads",
        "torch_threads",
        int,
        "torch's CPU threads (default: OMP_NUM_THREADS, else one per physical core)",
    ),
    ("--device", "device", str, "cpu or cuda (default: cuda when there is one)"),
    ("--dtype", "dtype", "dtype", "float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)"),
]


# The guards' defaults (README, "What can go wrong in a server"); each is a flag below.
MAX_REQUEST_BYTES = 4 << 20  # a body this big holds any prompt that fits an 8k context, many times over
MAX_QUEUED_REQUESTS = 256  # requests accepted beyond those that can run at once
HEALTH_TIMEOUT_S = 60.0  # a worker that has not come round its loop for this long is stuck
READ_TIMEOUT_S = 30.0  # a client must send a request's headers, and then its body, within this
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's default, on purpose)
MAX_CONNECTIONS = 512  # open connections + requests in progress; beyond: 503 (below the usual 1024-file limit)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def served_stage(knobs: dict[str, Any]) -> int:
    """Which stage's engine a server with these engine knobs runs (``build_engine`` builds it): 12
    with ``--tp-size`` above 1 (stage 11's engine split across ranks, overlapped or not as asked), 8
    with ``--disable-overlap``, else 11. The API process asks too: only stage 8's has no grammars."""
    if knobs.get("tp_size", 1) > 1:
        return 12
    return 8 if knobs.get("disable_overlap") else 11


@dataclass
class ServerArgs:
    model: str | None = None  # a model folder or hub id; None: the default model
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None  # the name clients pass as "model" (default: the folder's name)
    engine_knobs: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Engine(...)
    log_level: str = "warning"  # every process's logging, uvicorn's included
    enable_metrics: bool = False  # GET /metrics, for Prometheus (metrics.py)
    # --- the guards ---
    api_key: str | None = None  # if set, /v1/*, /debug/* and /metrics need "Authorization: Bearer <key>"
    enable_debug_endpoints: bool = False  # /debug/state and /debug/fault
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_prompt_chars: int | None = None  # None: context x the longest token (a prompt beyond cannot fit)
    max_queued_requests: int = MAX_QUEUED_REQUESTS
    request_timeout: float | None = None  # None: a request may take as long as it needs
    health_timeout: float = HEALTH_TIMEOUT_S
    read_timeout: float = READ_TIMEOUT_S
    keep_alive_timeout: int = KEEP_ALIVE_S
    max_connections: int = MAX_CONNECTIONS

    def model_names(self) -> list[str]:
        """The names a request may use for this model: the served name first, then the path as given."""
        names = [self.served_model_name or Path(str(self.model)).name]
        if self.model is not None and str(self.model) not in names:
            names.append(str(self.model))
        return names


def positive(kind):
    """An argparse type: ``kind`` (int or float), > 0."""

    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: the folder's name)"
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=LOG_LEVELS,
        help="every process's log level (info also logs every HTTP request)",
    )
    parser.add_argument(
        "--enable-metrics",
        action="store_true",
        help="serve GET /metrics: latencies, token counts and the engine's state for Prometheus; off by default",
    )
    guards = parser.add_argument_group("guards (see the stage 9 README: what can go wrong in a server)")
    guards.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /debug/* and /metrics"
    )
    guards.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve GET /debug/state (counts, invariants, pids) and POST /debug/fault (tests); off by default",
    )
    guards.add_argument(
        "--max-request-bytes",
        type=positive(int),
        default=MAX_REQUEST_BYTES,
        help="largest request body; larger: 413 before it is parsed (default %(default)s)",
    )
    guards.add_argument(
        "--max-prompt-chars",
        type=positive(int),
        default=None,
        help="longest prompt text in characters, checked before tokenizing "
        "(default: context x the longest token, beyond which no prompt can fit)",
    )
    guards.add_argument(
        "--max-queued-requests",
        type=int,
        default=MAX_QUEUED_REQUESTS,
        help="requests accepted beyond the max_running_requests that run at once; "
        "more: 503 with Retry-After (default %(default)s)",
    )
    guards.add_argument(
        "--request-timeout",
        type=positive(float),
        default=None,
        help="seconds a request may take; then it is aborted (its KV freed) and answered 504 (default: none)",
    )
    guards.add_argument(
        "--health-timeout",
        type=positive(float),
        default=HEALTH_TIMEOUT_S,
        help="/health says 503 if a worker has not come round its loop for this many seconds "
        "while requests are in flight (default %(default)s)",
    )
    guards.add_argument(
        "--read-timeout",
        type=positive(float),
        default=READ_TIMEOUT_S,
        help="seconds a client has to send a request's headers, and then its body (default %(default)s)",
    )
    guards.add_argument(
        "--keep-alive-timeout",
        type=positive(int),
        default=KEEP_ALIVE_S,
        help="seconds an idle keep-alive connection stays open (default %(default)s)",
    )
    guards.add_argument(
        "--max-connections",
        type=positive(int),
        default=MAX_CONNECTIONS,
        help="open connections + requests in progress; beyond: 503 (default %(default)s)",
    )
    for flag, _, kind, help_text in ENGINE_KNOBS:
        if kind in ("disable", "flag"):
            parser.add_argument(flag, action="store_true", help=help_text)
        else:
            parser.add_argument(flag, type=str if kind == "dtype" else kind, default=None, help=help_text)


def from_cli_args(args: argparse.Namespace) -> ServerArgs:
    from s00_foundation.paths import default_model_path

    knobs: dict[str, Any] = {}
    for flag, keyword, kind, _ in ENGINE_KNOBS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if kind in ("disable", "flag"):
            if value:
                knobs[keyword] = kind == "flag"
        elif value is not None:
            knobs[keyword] = value  # a dtype stays a string here: the scheduler process turns it into torch's
    if args.enable_overlap and args.disable_overlap:
        raise SystemExit("--enable-overlap and --disable-overlap contradict each other: give one of them")
    model = args.model if args.model is not None else str(default_model_path())
    if args.max_queued_requests < 0:
        raise SystemExit(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    guards = {
        name: getattr(args, name)
        for name in (
            "api_key",
            "enable_debug_endpoints",
            "max_request_bytes",
            "max_prompt_chars",
            "max_queued_requests",
            "request_timeout",
            "health_timeout",
            "read_timeout",
            "keep_alive_timeout",
            "max_connections",
        )
    }
    return ServerArgs(
        model=model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        engine_knobs=knobs,
        log_level=args.log_level,
        enable_metrics=args.enable_metrics,
        **guards,
    )
