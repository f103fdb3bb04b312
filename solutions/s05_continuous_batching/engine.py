"""``ContinuousBatchingEngine`` (the package's ``Engine``): continuous batching behind two small APIs.

Offline, the whole workload at once (outputs in the prompts' order, with per-request stats)::

    engine = Engine()        # the default model; or Engine("Qwen/Qwen3-0.6B"), Engine(model, tokenizer)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=64))

Step by step, for a server that streams (stage 9 drives this)::

    engine.add_request("Hi!", params, rid="a")          # ValueError if it could never be served
    while engine.has_work:
        for out in engine.step():                       # one forward pass
            print(out.rid, out.new_token_ids, out.finish_reason)

The engine owns a ``ModelRunner`` (the model, the KV pool, the table, the attention backend) and
a ``Scheduler`` (which decides what runs each step); everything else is wiring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Hashable, Sequence

import torch

from s00_foundation.loader import load_model
from s00_foundation.model import CausalLM
from s00_foundation.paths import default_model_path
from s00_foundation.tokenizer import Tokenizer
from s02_request_and_sampling.engine import (
    GenerateOutput,
    PromptInput,
    check_fits_the_vocabulary,
    encode,
    make_output,
    pair_prompts_with_params,
)
from s02_request_and_sampling.req import FinishReason, Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool.model_runner import ModelRunner

from .prefix_cache import NoPrefixCache
from .scheduler import Scheduler, TokenOutput
from .trace import StepTrace, print_trace

# Defaults that keep a large batch full on the default model (SmolLM2-135M: 46 KB of float32 K/V
# per token on a CPU). 128 requests run at once; the CPU pool is 2 GiB, ~46k tokens: 128 requests
# of ~360 tokens each, or 8 of 1500 + 32 (the README's benchmark workloads b and d, at full batch).
DEFAULT_MAX_RUNNING_REQUESTS = 128
CPU_POOL_BYTES = 2 << 30  # a CPU engine's default KV pool: at most 2 GiB ...
CPU_POOL_TOKENS = 1 << 16  # ... and at most this many slots (a tiny model's pool stays small)
GPU_POOL_FRACTION = 0.5  # a CUDA engine's default KV pool: this share of the free GPU memory


@dataclass
class RequestOutput(GenerateOutput):
    """Stage 2's output plus per-request timing; a rejected request has no tokens, finish_reason
    "abort", the error in ``error`` and the seed it was given (None if it had none)."""

    ttft: float | None  # seconds from arrival to the first token (None if it never got one)
    latency: float | None  # seconds from arrival to the end (None if it never ran)
    error: str | None = None  # why the request was rejected or its grammar failed (finish_reason "abort")


def default_pool_size(model: CausalLM, page_size: int, max_running_requests: int, max_context_len: int) -> int:
    """KV slots when the caller does not say. On CUDA: half the free GPU memory (the model is
    already loaded), but never more than ``max_running_requests`` full contexts could fill: half
    of an H200 is ~3M slots of SmolLM2, far beyond 128 x 8192, and every slot costs a Python
    free-list entry and start-up time. On a CPU: 2 GiB or 65536 slots, whichever is smaller."""
    per_token = model.config.kv_bytes_per_token(model.dtype)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        tokens = min(int(GPU_POOL_FRACTION * free) // per_token, max_running_requests * max_context_len)
    else:
        tokens = min(CPU_POOL_TOKENS, CPU_POOL_BYTES // per_token)
    return max(page_size, tokens // page_size * page_size)


def request_output(req: Req) -> RequestOutput:
    times = req.time_stats
    arrival = times.arrival
    return RequestOutput(
        **vars(make_output(req)),
        ttft=None if times.first_token is None or arrival is None else times.first_token - arrival,
        latency=None if times.finished is None or arrival is None else times.finished - arrival,
        error=req.grammar_error,  # stage 11: an aborted request says why its grammar failed
    )


def rejected_output(prompt_tokens: int, params: SamplingParams, error: Exception) -> RequestOutput:
    return RequestOutput(
        text="",
        output_ids=[],
        finish_reason=FinishReason("abort"),
        prompt_tokens=prompt_tokens,
        output_tokens=0,
        seed=params.seed,
        logprobs=None,
        prompt_logprobs=None,
        ttft=None,
        latency=None,
        error=str(error),
    )


@dataclass
class EngineConfig:
    """How an engine is built. ``ContinuousBatchingEngine(model, page_size=4)`` fills one from its
    keyword arguments; later stages extend it with their own fields (stage 6's RadixEngineConfig...).

    ``pool_size``: KV slots (default: see ``default_pool_size``); ``max_running_requests``: table
    rows, the most requests in one pass; ``max_prefill_tokens`` and ``new_token_ratio``: see
    ``Scheduler``. ``trace=True`` prints one line per step; a callable gets each step's
    ``StepTrace`` instead. ``device`` and ``dtype``: where a model loaded from a path runs."""

    pool_size: int | None = None
    page_size: int = 1
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    max_prefill_tokens: int = 4096
    new_token_ratio: float = 0.5
    max_context_len: int | None = None
    attention_backend: str = "auto"
    trace: bool | Callable[[StepTrace], None] = False
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None


class ContinuousBatchingEngine:
    config_class: ClassVar[type[EngineConfig]] = EngineConfig  # a later stage names its own config here

    def __init__(
        self,
        model: str | Path | CausalLM | None = None,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        **options: Any,
    ):
        """``model``: a model folder or hub id (default: SmolLM2-135M-Instruct), loaded with its
        tokenizer, or an already loaded ``CausalLM`` (then pass ``tokenizer`` to use text prompts;
        without one, prompts are token ids). ``config``, or its fields as keyword ``options``
        (options given with a config replace its fields): see ``EngineConfig``."""
        self.config = config = self.make_config(config, **options)
        if model is None or isinstance(model, (str, Path)):
            path = model if model is not None else default_model_path()
            model = load_model(path, device=config.device, dtype=config.dtype)
            tokenizer = tokenizer or Tokenizer(path)
        self.model, self.tokenizer = model, tokenizer
        max_context_len = config.max_context_len
        pool_size = config.pool_size
        if pool_size is None:
            context = max_context_len or model.config.max_position_embeddings
            pool_size = default_pool_size(model, config.page_size, config.max_running_requests, context)
        self.runner = self.make_runner(
            pool_size, max_context_len or min(model.config.max_position_embeddings, pool_size)
        )
        self.scheduler = self.make_scheduler()
        self._next_rid = 0

    # --- the seams later stages plug into -----------------------------------------------------------

    @classmethod
    def make_config(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """``config`` with ``options`` replacing its fields, or this engine's config_class from
        ``options`` alone (a TypeError names an unknown option)."""
        if config is None:
            return cls.config_class(**options)
        if not isinstance(config, cls.config_class):
            raise TypeError(f"{cls.__name__} takes a {cls.config_class.__name__}, got a {type(config).__name__}")
        return replace(config, **options) if options else config

    def make_runner(self, pool_size: int, max_context_len: int) -> ModelRunner:
        """The ModelRunner over ``self.model`` (stage 8 returns one that replays CUDA graphs)."""
        c = self.config
        return ModelRunner(
            self.model, pool_size, c.page_size, c.max_running_requests, max_context_len, c.attention_backend
        )

    def scheduler_options(self) -> dict[str, Any]:
        """The Scheduler's knobs from the config (every stage's scheduler takes them)."""
        c = self.config
        on_step = print_trace if c.trace is True else (c.trace or None)
        return dict(max_prefill_tokens=c.max_prefill_tokens, new_token_ratio=c.new_token_ratio, on_step=on_step)

    def make_scheduler(self) -> Scheduler:
        """The Scheduler over ``self.runner`` (stage 6 plugs in the radix cache, stage 7 chunks prefills)."""
        return Scheduler(self.runner, NoPrefixCache(self.runner.allocator), **self.scheduler_options())

    # --- the step API -----------------------------------------------------------------------------

    def make_req(
        self, prompt: PromptInput, sampling_params: SamplingParams | None = None, rid: Hashable | None = None
    ) -> Req:
        """A ``Req`` for ``prompt`` (text, chat messages or token ids); rid defaults to a counter."""
        if rid is None:
            rid, self._next_rid = self._next_rid, self._next_rid + 1
        ids, params = encode(self.tokenizer, prompt), sampling_params or SamplingParams()
        check_fits_the_vocabulary(ids, params, self.model.config.vocab_size)
        eos = self.model.config.eos_token_ids if self.tokenizer is None else None  # None: the tokenizer's
        return Req(rid, ids, params, tokenizer=self.tokenizer, eos_token_ids=eos)

    def add_request(
        self, prompt: PromptInput, sampling_params: SamplingParams | None = None, rid: Hashable | None = None
    ) -> Req:
        """Queue one request; raises ValueError if it is malformed or could never be served."""
        req = self.make_req(prompt, sampling_params, rid)
        self.scheduler.add_request(req)
        return req

    def step(self) -> list[TokenOutput]:
        with torch.inference_mode():
            return self.scheduler.step()

    def abort_request(self, rid: Hashable) -> bool:
        return self.scheduler.abort_request(rid)

    def abort_failed_step(self) -> list[Req]:
        """After ``step()`` raised: end its requests and free everything they held (see the scheduler's)."""
        return self.scheduler.abort_failed_step()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def fatal_error(self) -> str | None:
        """Why no step can ever run again, or None. A failed step ends its own requests and the
        engine goes on; this is for what cannot be undone (stage 12: a rank of the group died),
        where a server must stop rather than fail every later request."""
        return None

    # --- the offline API --------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; the outputs come back in the prompts' order.

        ``prompts`` is a list of prompts (a single string is accepted as a list of one);
        ``sampling_params`` is one SamplingParams for all or one per prompt. A request that
        cannot be served (a malformed prompt, ids or a top_k beyond the vocabulary, or one that
        could never fit the model's context or the KV pool) does not stop the others: its output
        has finish_reason "abort", no tokens, and ``error`` says why. Every other request runs as
        if it were alone. A step that raises (or Ctrl-C) ends every request and passes the error
        on, leaving the engine idle.
        """
        if self.has_work:
            raise RuntimeError(
                "generate() needs an idle engine, but requests added with add_request are still in flight"
            )
        entries: list[Req | RequestOutput] = []  # in the prompts' order, whatever order they finish in
        for prompt, params in pair_prompts_with_params(prompts, sampling_params):
            req = None
            try:
                req = self.make_req(prompt, params)
                self.scheduler.add_request(req)
                entries.append(req)
            except ValueError as error:
                entries.append(rejected_output(len(req.origin_input_ids) if req else 0, params, error))
        try:
            while self.has_work:
                self.step()
        except BaseException:
            # A step that raised (or Ctrl-C): end every request, free what they hold, and pass the
            # error on; the engine is idle again, ready for the next call.
            self.abort_failed_step()
            for req in list(self.scheduler.waiting):
                self.abort_request(req.rid)
            raise
        return [request_output(e) if isinstance(e, Req) else e for e in entries]


Engine = ContinuousBatchingEngine  # the stage's public name: every stage package has an Engine
