"""Stage 7's engine with CUDA graphs for decode: same APIs, plus ``cuda_graph_max_bs`` and
``disable_cuda_graph``::

    engine = Engine()                                  # graphs on CUDA; every pass eager on a CPU
    engine = Engine(disable_cuda_graph=False)          # graph runner everywhere (a CPU runs its path eagerly)
    engine = Engine(cuda_graph_max_bs=32)              # decodes of up to 32 requests replay graphs
    engine = Engine(disable_cuda_graph=True)           # every pass eager, as in the stages before
    engine.runner.forward_paths                        # Counter({"graph": ..., "eager": ...})

Only the runner changes (stage 5's ``make_runner`` seam): scheduling, the radix cache and the
outputs are the base engine's. On CUDA the model loads in bfloat16 by default (s00 device.py).
"""

from __future__ import annotations

from s07_chunked_prefill.engine import Engine as BaseEngine

from .model_runner import ModelRunner


class Engine(BaseEngine):
    def __init__(self, model=None, tokenizer=None, *, cuda_graph_max_bs: int | None = None,
                 disable_cuda_graph: bool | None = None, **knobs):
        """``model``, ``tokenizer`` and ``knobs``: see the base engine. ``cuda_graph_max_bs``:
        the largest decode batch run through the graph runner (default min(max_running_requests, 64)).
        ``disable_cuda_graph``: True runs every pass eagerly, False always uses the graph runner;
        the default (None) uses it on CUDA only. On a CPU there is nothing to capture and the
        padded static path only costs (about 18% of offline throughput on the default model,
        measured), so it runs there when asked (the tests and notebook 08 ask)."""
        self.cuda_graph_max_bs, self.disable_cuda_graph = cuda_graph_max_bs, disable_cuda_graph
        super().__init__(model, tokenizer, **knobs)

    def make_runner(self, **runner_args) -> ModelRunner:
        disable = self.disable_cuda_graph
        if disable is None:
            disable = self.model.device.type != "cuda"
        return ModelRunner(self.model, **runner_args, cuda_graph_max_bs=self.cuda_graph_max_bs, disable_cuda_graph=disable)
