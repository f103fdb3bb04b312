"""Stage 4's ``ModelRunner`` with a ``CudaGraphRunner``: decodes replay graphs, the rest runs eagerly.

    forward(batch)
      ├─ decode, at most cuda_graph_max_bs requests ─▶ cuda_graph_runner.replay(batch)   path "graph"
      │                                                 (on a CPU: the same padded static batch, eagerly)
      └─ prefill / mixed prefill + decode / larger  ─▶ stage 4's forward                 path "eager"

``forward_paths`` counts the passes of each path and ``last_forward_path`` names the last one,
so a test or a benchmark can see which path ran.
"""

from __future__ import annotations

from collections import Counter

import torch

from s00_foundation.forward_batch import ForwardBatch
from s00_foundation.model import CausalLM
from s04_paged_kv_pool.flash_backend import FlashAttentionBackend
from s04_paged_kv_pool.model_runner import ModelRunner as EagerModelRunner

from .cuda_graph_runner import CudaGraphRunner, reserve_dummy_row
from .graph_attention import GraphAttentionBackend, GraphFlashAttentionBackend

DEFAULT_CUDA_GRAPH_MAX_BS = 64


class ModelRunner(EagerModelRunner):
    def __init__(
        self,
        model: CausalLM,
        pool_size: int,
        page_size: int = 1,
        max_running_requests: int = 64,
        max_context_len: int | None = None,
        attention_backend: str = "auto",
        *,
        cuda_graph_max_bs: int | None = None,
        disable_cuda_graph: bool = False,
    ):
        """Stage 4's arguments, plus ``cuda_graph_max_bs`` (the largest decode batch a graph
        runs; default min(max_running_requests, 64)) and ``disable_cuda_graph`` (every pass
        eager, exactly as stage 4)."""
        super().__init__(model, pool_size, page_size, max_running_requests, max_context_len, attention_backend)
        self.forward_paths: Counter[str] = Counter()
        self.last_forward_path: str | None = None
        self.cuda_graph_runner: CudaGraphRunner | None = None
        if disable_cuda_graph:
            return
        # Stage 4's backend, plus the static decode path a graph can replay.
        graph_backend = GraphFlashAttentionBackend if isinstance(self.attn_backend, FlashAttentionBackend) else GraphAttentionBackend
        self.attn_backend = graph_backend(self.req_to_token_pool, self.token_to_kv_pool)
        dummy_row = reserve_dummy_row(self.req_to_token_pool)
        max_bs = cuda_graph_max_bs if cuda_graph_max_bs is not None else min(max_running_requests, DEFAULT_CUDA_GRAPH_MAX_BS)
        self.cuda_graph_runner = CudaGraphRunner(self, max_bs, dummy_row)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_reqs, vocab] at each request's last new token, by whichever path fits."""
        # BEGIN EXERCISE: when there is a cuda_graph_runner and it can_run the batch, replay it (path "graph"); otherwise stage 4's forward (super().forward, path "eager"); record the path in self.last_forward_path and count it in self.forward_paths
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(batch):
            path, logits = "graph", self.cuda_graph_runner.replay(batch)
        else:
            path, logits = "eager", super().forward(batch)
        # END EXERCISE
        self.last_forward_path = path
        self.forward_paths[path] += 1
        return logits
