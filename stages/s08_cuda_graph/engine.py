"""Stage 7's engine with batched decode attention and CUDA graphs: same APIs, plus these knobs::

    engine = Engine()                                  # graphs on CUDA; every pass eager on a CPU
    engine = Engine(disable_cuda_graph=False)          # graph runner everywhere (a CPU runs its path eagerly)
    engine = Engine(cuda_graph_max_bs=32)              # decodes of up to 32 requests replay graphs
    engine = Engine(disable_cuda_graph=True)           # every pass eager (decodes still batched)
    engine = Engine(torch_threads=1)                   # torch's CPU threads (default: one per physical core)
    engine = Engine(enable_torch_compile=True)         # the layers' math through Inductor (slow start; torch_compile.py)
    engine.runner.forward_paths                        # Counter({"graph": ..., "eager": ...})
    engine.describe()                                  # device, threads, attention, graphs, pool

Only the runner changes (stage 5's ``make_runner`` seam): scheduling, the radix cache and the
outputs are the base engine's. On CUDA the model loads in bfloat16 by default (s00 device.py).
This is the engine ``make serve`` runs.
"""

from __future__ import annotations

from s00_foundation.device import describe, set_torch_threads
from s07_chunked_prefill.engine import Engine as BaseEngine

from .cuda_graph_runner import DEFAULT_CUDA_GRAPH_MAX_KV_LEN
from .model_runner import ModelRunner


class Engine(BaseEngine):
    def __init__(self, model=None, tokenizer=None, *, cuda_graph_max_bs: int | None = None,
                 cuda_graph_max_kv_len: int = DEFAULT_CUDA_GRAPH_MAX_KV_LEN, disable_cuda_graph: bool | None = None,
                 torch_threads: int | None = None, enable_torch_compile: bool = False, **knobs):
        """``model``, ``tokenizer`` and ``knobs``: see the base engine. ``cuda_graph_max_bs``:
        the largest decode batch run through the graph runner (default min(max_running_requests, 64));
        ``cuda_graph_max_kv_len``: the longest sequence it takes (longer decodes run eagerly).
        ``disable_cuda_graph``: True runs every pass eagerly, False always uses the graph runner;
        the default (None) uses it on CUDA only: on a CPU there is nothing to capture and the padded
        static path only costs (the padding rows and keys; the eager decode is already one batched
        attention per layer), so it runs there when asked (the tests and notebook 08 ask).
        ``torch_threads``: torch's CPU thread count, set for the whole process (default:
        OMP_NUM_THREADS if set, else one per physical core; see s00 device.py).
        ``enable_torch_compile``: compile the decoder layers with torch.compile (torch_compile.py);
        the first passes pay the compilation."""
        self.torch_threads = set_torch_threads(torch_threads)
        self.cuda_graph_max_bs, self.cuda_graph_max_kv_len = cuda_graph_max_bs, cuda_graph_max_kv_len
        self.disable_cuda_graph, self.enable_torch_compile = disable_cuda_graph, enable_torch_compile
        super().__init__(model, tokenizer, **knobs)

    def make_runner(self, **runner_args) -> ModelRunner:
        disable = self.disable_cuda_graph
        if disable is None:
            disable = self.model.device.type != "cuda"
        return ModelRunner(self.model, **runner_args, cuda_graph_max_bs=self.cuda_graph_max_bs,
                           cuda_graph_max_kv_len=self.cuda_graph_max_kv_len, disable_cuda_graph=disable,
                           enable_torch_compile=self.enable_torch_compile)

    def describe(self) -> str:
        """One line per part: where it runs, how attention runs, the graphs, the KV pool."""
        runner = self.runner
        graphs = runner.cuda_graph_runner.describe() if runner.cuda_graph_runner else "CUDA graphs: off"
        return "\n".join([
            f"device: {describe(self.model.device)}, {str(self.model.dtype).removeprefix('torch.')}",
            f"attention: {runner.attention_backend_name}, decodes batched (one attention call per layer)",
            f"graphs: {graphs}",
            f"torch.compile: {'on (the decoder layers; attention eager)' if self.enable_torch_compile else 'off'}",
            f"KV pool: {runner.allocator.size} slots ({runner.token_to_kv_pool.nbytes / 2**20:.0f} MiB), "
            f"up to {runner.req_to_token_pool.size} requests of {runner.req_to_token_pool.max_context_len} tokens",
        ])
