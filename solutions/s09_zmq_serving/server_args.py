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
    ("--chunked-prefill-size", "chunked_prefill_size", int, "prompt tokens per step; longer prompts are chunked (stage 7)"),
    ("--cuda-graph-max-bs", "cuda_graph_max_bs", int, "largest decode batch replayed from a CUDA graph (stage 8)"),
    ("--cuda-graph-max-kv-len", "cuda_graph_max_kv_len", int, "longest sequence a CUDA graph decodes; longer ones run eagerly (stage 8)"),
    ("--disable-cuda-graph", "disable_cuda_graph", "flag", "run every decode eagerly (stage 8; by default graphs run on CUDA only)"),
    ("--torch-threads", "torch_threads", int, "torch's CPU threads (default: OMP_NUM_THREADS, else one per physical core)"),
    ("--device", "device", str, "cpu or cuda (default: cuda when there is one)"),
    ("--dtype", "dtype", "dtype", "float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)"),
]


@dataclass
class ServerArgs:
    model: str | None = None  # a model folder or hub id; None: the default model
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None  # the name clients pass as "model" (default: the folder's name)
    engine_knobs: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Engine(...)
    log_level: str = "warning"

    def model_names(self) -> list[str]:
        """The names a request may use for this model: the served name first, then the path as given."""
        names = [self.served_model_name or Path(str(self.model)).name]
        if self.model is not None and str(self.model) not in names:
            names.append(str(self.model))
        return names


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: the folder's name)")
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level (info prints every HTTP request)")
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
    model = args.model if args.model is not None else str(default_model_path())
    return ServerArgs(model=model, host=args.host, port=args.port, served_model_name=args.served_model_name,
                      engine_knobs=knobs, log_level=args.log_level)
