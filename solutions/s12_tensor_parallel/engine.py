"""``TPEngine`` (the package's ``Engine``): stage 11's engine on a tensor-parallel group::

    engine = Engine(model_path, tp_size=2)    # rank 0 here, rank 1 started as its own process
    engine.generate(prompts, params)          # the same tokens as tp_size=1
    engine.tp.counts                          # collectives rank 0 called: all_reduce, gather, broadcast
    engine.shutdown()                         # or `with Engine(...) as engine:`; no process is left

Rank 0 (this process) does everything stages 10 and 11 do: it schedules (overlapped where it
pays, as SGLang does under TP), masks and samples from the full logits and streams. What changes
is underneath:

- the model is ``TPCausalLM`` (model.py), each rank loading only its slices (weight_loader.py);
- the runner (``TPModelRunner``) broadcasts each step's batch to the other ranks before it runs
  the forward, so every rank runs the same batch at the same time (tp_worker.py);
- the KV pool holds this rank's KV heads only (built from the rank's config, model.py).

Sampling stays on rank 0, on the gathered logits, with stage 2's sampler untouched: seeded
sampling gives the same tokens as one device, and a grammar mask (stage 11) sees the whole
vocabulary. Decodes run eagerly under TP (no CUDA graphs: capturing collectives in a graph is
left out of this stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from s00_foundation.config import ModelConfig
from s00_foundation.device import default_device, set_torch_threads
from s00_foundation.loader import resolve_model_path
from s00_foundation.paths import default_model_path
from s00_foundation.tokenizer import Tokenizer
from s05_continuous_batching.engine import EngineConfig
from s11_structured_output import engine as base  # the stage this engine builds on

from .launch import TPLauncher
from .model import TPCausalLM, rank_config
from .model_runner import TPModelRunner, make_tp_runner
from .parallel_state import DEFAULT_TIMEOUT_S, TPGroup
from .tp_worker import RunnerSpec
from .weight_loader import load_tp_model


@dataclass
class TPEngineConfig(base.StructuredOutputEngineConfig):
    """The base engine's fields, plus ``tp_size`` (ranks the model is split over; 1: one
    process, the same code) and ``tp_timeout_s`` (how long a forward's collective waits for a
    silent rank before the group stops with an error)."""

    tp_size: int = 1
    tp_timeout_s: float = DEFAULT_TIMEOUT_S


class TPEngine(base.StructuredOutputEngine):
    config_class: ClassVar[type[EngineConfig]] = TPEngineConfig
    config: TPEngineConfig
    runner: TPModelRunner

    def __init__(
        self,
        model: str | Path | None = None,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        **options: Any,
    ):
        """``model``: a model folder or hub id (each rank loads its own slices, so a loaded model
        cannot be passed). The other ranks start before the model loads and stop at ``shutdown``."""
        config = cast(TPEngineConfig, self.make_config(config, **options))
        if not isinstance(model, (str, Path, type(None))):
            raise TypeError(
                "a tensor-parallel engine loads its model itself on every rank: "
                f"pass a model folder, not a {type(model).__name__}"
            )
        if config.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {config.tp_size}")
        path = str(resolve_model_path(model if model is not None else default_model_path()))
        device = torch.device(config.device or default_device())
        if device.type == "cuda" and config.tp_size > torch.cuda.device_count():
            visible = torch.cuda.device_count()
            raise ValueError(f"tp_size={config.tp_size} needs {config.tp_size} GPUs, {visible} are visible")
        # Shapes that cannot be split fail here, before any process starts.
        rank_config(ModelConfig.from_folder(path), TPGroup(0, config.tp_size, device))
        set_torch_threads(config.torch_threads)
        self.launcher = TPLauncher(config.tp_size, device, config.tp_timeout_s)
        self.tp: TPGroup | None = None
        try:
            self.tp = self.launcher.start()
            tp_model = load_tp_model(path, self.tp, device, config.dtype)
            super().__init__(tp_model, tokenizer or Tokenizer(path), config)
            if self.tp.size > 1:
                pool, table = self.runner.allocator, self.runner.req_to_token_pool
                self.tp.broadcast_object(RunnerSpec(path, tp_model.dtype, config, pool.size, table.max_context_len))
                self.tp.barrier()
        except BaseException:
            self.shutdown()
            raise

    def make_runner(self, pool_size: int, max_context_len: int) -> TPModelRunner:
        assert self.tp is not None
        return make_tp_runner(cast(TPCausalLM, self.model), self.config, pool_size, max_context_len, self.tp)

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group (idempotent)."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and scheduler.worker is not None:
            scheduler.worker.wait_idle()  # no forward may be talking to the group while it stops
        self.launcher.stop(self.tp)
        self.tp = None

    def __enter__(self) -> "TPEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def fatal_error(self) -> str | None:
        """A group that stopped (a rank died, a collective failed or timed out, rank 0's forward
        failed midway) cannot run another step: a server stops, saying why, rather than fail every
        later request while it looks healthy."""
        if self.tp is not None and self.tp.failed is not None:
            return f"the tensor-parallel group has stopped: {self.tp.failed}"
        return None

    def forward_threads(self) -> int:
        """Every rank computes each step, each on torch's thread count (on a CPU, one machine)."""
        return torch.get_num_threads() * self.config.tp_size

    def describe(self) -> str:
        c = cast(TPCausalLM, self.model).config
        return super().describe() + (
            f"\ntensor parallel: {self.config.tp_size} rank(s); this rank: {c.num_attention_heads} query heads, "
            f"{c.num_key_value_heads} KV heads"
        )


Engine = TPEngine  # the stage's public name
