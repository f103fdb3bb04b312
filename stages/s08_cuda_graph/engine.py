"""Stage 7's engine with CUDA graphs for decode: same APIs, plus ``cuda_graph_max_bs`` and
``disable_cuda_graph``::

    engine = Engine()                                  # graphs on (CUDA: captured; CPU: the same path eagerly)
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
                 disable_cuda_graph: bool = False, **knobs):
        """``model``, ``tokenizer`` and ``knobs``: see the base engine. ``cuda_graph_max_bs``:
        the largest decode batch run through the graph runner (default min(max_running_requests, 64));
        ``disable_cuda_graph=True``: no graph runner at all, for comparison."""
        self.cuda_graph_max_bs, self.disable_cuda_graph = cuda_graph_max_bs, disable_cuda_graph
        super().__init__(model, tokenizer, **knobs)

    def make_runner(self, **runner_args) -> ModelRunner:
        return ModelRunner(self.model, **runner_args, cuda_graph_max_bs=self.cuda_graph_max_bs,
                           disable_cuda_graph=self.disable_cuda_graph)
