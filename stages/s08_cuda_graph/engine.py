"""``CudaGraphEngine`` (the package's ``Engine``): stage 7's engine with batched decode attention
and CUDA graphs, same APIs, plus these config fields::

    engine = Engine()                                  # graphs on CUDA; every pass eager on a CPU
    engine = Engine(disable_cuda_graph=False)          # graph runner everywhere (a CPU runs its path eagerly)
    engine = Engine(cuda_graph_max_bs=32)              # decodes of up to 32 requests replay graphs
    engine = Engine(disable_cuda_graph=True)           # every pass eager (decodes still batched)
    engine = Engine(torch_threads=1)                   # torch's CPU threads (default: one per physical core)
    engine = Engine(enable_torch_compile=True)         # the layers' math through Inductor (slow start)
    engine.runner.forward_paths                        # Counter({"graph": ..., "eager": ...})
    engine.describe()                                  # device, threads, attention, graphs, pool

Only the runner changes (stage 5's ``make_runner`` seam): scheduling, the radix cache and the
outputs are the base engine's. On CUDA the model loads in bfloat16 by default (s00 device.py).
This is the engine ``make serve`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

from s00_foundation import cpu_ops
from s00_foundation.device import describe, set_torch_threads
from s00_foundation.linear import linear_kind
from s00_foundation.model import CausalLM
from s00_foundation.tokenizer import Tokenizer
from s05_continuous_batching.engine import EngineConfig
from s07_chunked_prefill.engine import ChunkedPrefillEngine, ChunkedPrefillEngineConfig

from .cuda_graph_runner import DEFAULT_CUDA_GRAPH_MAX_KV_LEN
from .model_runner import GraphModelRunner


@dataclass
class CudaGraphEngineConfig(ChunkedPrefillEngineConfig):
    """Stage 7's fields, plus: ``cuda_graph_max_bs``, the largest decode batch run through the
    graph runner (default min(max_running_requests, 64)); ``cuda_graph_max_kv_len``, the longest
    sequence it takes (longer decodes run eagerly). ``disable_cuda_graph``: True runs every pass
    eagerly, False always uses the graph runner; the default (None) uses it on CUDA only: on a CPU
    there is nothing to capture and the padded static path only costs (the padding rows and keys;
    the eager decode is already one batched attention per layer), so it runs there when asked
    (the tests and notebook 08 ask). ``torch_threads``: torch's CPU thread count, set for the
    whole process (default: OMP_NUM_THREADS if set, else one per physical core; see s00
    device.py). ``enable_torch_compile``: compile the decoder layers with torch.compile
    (torch_compile.py); the first passes pay the compilation."""

    cuda_graph_max_bs: int | None = None
    cuda_graph_max_kv_len: int = DEFAULT_CUDA_GRAPH_MAX_KV_LEN
    disable_cuda_graph: bool | None = None
    torch_threads: int | None = None
    enable_torch_compile: bool = False


class CudaGraphEngine(ChunkedPrefillEngine):
    config_class: ClassVar[type[EngineConfig]] = CudaGraphEngineConfig
    config: CudaGraphEngineConfig
    runner: GraphModelRunner

    def __init__(
        self,
        model: str | Path | CausalLM | None = None,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        **options: Any,
    ):
        """As stage 5's; torch's thread count (a setting of the whole process) is set first, before
        the model loads."""
        config = cast(CudaGraphEngineConfig, self.make_config(config, **options))  # make_config checks the class
        set_torch_threads(config.torch_threads)
        super().__init__(model, tokenizer, config)

    def make_runner(self, pool_size: int, max_context_len: int) -> GraphModelRunner:
        c = self.config
        disable = c.disable_cuda_graph
        if disable is None:
            disable = self.model.device.type != "cuda"
        return GraphModelRunner(
            self.model,
            pool_size,
            c.page_size,
            c.max_running_requests,
            max_context_len,
            c.attention_backend,
            cuda_graph_max_bs=c.cuda_graph_max_bs,
            cuda_graph_max_kv_len=c.cuda_graph_max_kv_len,
            disable_cuda_graph=disable,
            enable_torch_compile=c.enable_torch_compile,
        )

    def describe(self) -> str:
        """One line per part: where it runs, how attention runs, the graphs, the KV pool."""
        runner = self.runner
        graphs = runner.cuda_graph_runner.describe() if runner.cuda_graph_runner else "CUDA graphs: off"
        return "\n".join(
            [
                f"device: {describe(self.model.device)}, {str(self.model.dtype).removeprefix('torch.')}",
                f"attention: {runner.attention_backend_name} (one attention call per layer)",
                f"linear layers: {linear_kind(self.model.device)}",
                f"norms, SiLU, RoPE: {cpu_ops.kind(self.model.device)}",
                f"graphs: {graphs}",
                "torch.compile: "
                + ("on (the decoder layers; attention eager)" if self.config.enable_torch_compile else "off"),
                f"KV pool: {runner.allocator.size} slots ({runner.token_to_kv_pool.nbytes / 2**20:.0f} MiB), "
                f"up to {runner.req_to_token_pool.size} requests of {runner.req_to_token_pool.max_context_len} tokens",
            ]
        )


Engine = CudaGraphEngine  # the stage's public name
