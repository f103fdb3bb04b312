"""``GraphModelRunner``: stage 4's ``ModelRunner`` with batched decode attention and a ``CudaGraphRunner``.

    forward(batch)
      ├─ decode, at most cuda_graph_max_bs requests ─▶ cuda_graph_runner.replay(batch)   path "graph"
      │  of at most cuda_graph_max_kv_len tokens         (on a CPU: the same padded static batch, eagerly)
      └─ anything else                              ─▶ stage 4's forward                 path "eager"
         (prefill, mixed, larger, longer)                with DecodeAttentionBackend: decode rows in one
                                                         batched attention per layer (a CPU: the fused
                                                         kernel, no gather), extends per request

``forward_paths`` counts the passes of each path and ``last_forward_path`` names the last one,
so a test or a benchmark can see which path ran.
"""

from __future__ import annotations

from collections import Counter

import torch

from s00_foundation.forward_batch import ForwardBatch
from s00_foundation.linear import prepack
from s00_foundation.model import CausalLM
from s04_paged_kv_pool.flash_backend import FlashAttentionBackend
from s04_paged_kv_pool.model_runner import ModelRunner

from .cuda_graph_runner import DEFAULT_CUDA_GRAPH_MAX_KV_LEN, CudaGraphRunner, reserve_dummy_row
from .decode_attention import DecodeAttentionBackend, DecodeFlashAttentionBackend
from .torch_compile import compile_model

DEFAULT_CUDA_GRAPH_MAX_BS = 64


class GraphModelRunner(ModelRunner):
    attn_backend: DecodeAttentionBackend  # stage 4's, with decodes batched (set in __init__)

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
        cuda_graph_max_kv_len: int = DEFAULT_CUDA_GRAPH_MAX_KV_LEN,
        disable_cuda_graph: bool = False,
        enable_torch_compile: bool = False,
    ):
        """Stage 4's arguments, plus ``cuda_graph_max_bs`` (the largest decode batch a graph
        runs; default min(max_running_requests, 64)), ``cuda_graph_max_kv_len`` (the longest
        sequence a graph's decode attends over), ``disable_cuda_graph`` (no graphs: every pass
        eager, with the batched decode attention) and ``enable_torch_compile`` (torch_compile.py:
        before the graphs are captured, so that they record the compiled code)."""
        super().__init__(model, pool_size, page_size, max_running_requests, max_context_len, attention_backend)
        self.forward_paths: Counter[str] = Counter()
        self.last_forward_path: str | None = None
        # Stage 4's backend, with decodes batched: one attention call per layer, eager or replayed.
        backend = (
            DecodeFlashAttentionBackend
            if isinstance(self.attn_backend, FlashAttentionBackend)
            else DecodeAttentionBackend
        )
        self.attn_backend = backend(self.req_to_token_pool, self.token_to_kv_pool)
        if enable_torch_compile:
            compile_model(model)  # Inductor lays out the weights of what it compiles itself
        else:
            # The CPU's start-up work, as capturing the graphs is the GPU's: the products' prepacked
            # weights are made now, not in the first request's pass (s00 linear.py)
            prepack(model)
        self.cuda_graph_runner: CudaGraphRunner | None = None
        if disable_cuda_graph:
            return
        dummy_row = reserve_dummy_row(self.req_to_token_pool)
        max_bs = (
            cuda_graph_max_bs if cuda_graph_max_bs is not None else min(max_running_requests, DEFAULT_CUDA_GRAPH_MAX_BS)
        )
        self.cuda_graph_runner = CudaGraphRunner(self, max_bs, cuda_graph_max_kv_len, dummy_row)

    @property
    def attention_backend_name(self) -> str:
        """Stage 4's name, and how eager decodes run (decode_attention.py's DECODE_PATHS) and why."""
        how = {
            "gathered": "over the gathered block",
            "table": "through the table, no gather",
            "fused": "by the fused CPU kernel, no gather",
        }[self.attn_backend.decode_path]
        backend = self.attn_backend
        if backend.extend_path == "fused":
            extends = f"; extends by the fused CPU kernel ({backend.extend_path_reason})"
        elif self.device.type == "cpu":
            extends = f"; extends by SDPA, one call per request ({backend.extend_path_reason})"
        else:
            extends = ""
        return f"{super().attention_backend_name}; decodes batched, {how} ({backend.decode_path_reason}){extends}"

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_reqs, vocab] at each request's last new token, by whichever path fits."""
        # BEGIN EXERCISE: replay a graph when one can run the batch, else the eager pass [#what-you-write]
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(batch):
            path, logits = "graph", self.cuda_graph_runner.replay(batch)
        else:
            path, logits = "eager", super().forward(batch)
        self.last_forward_path = path
        self.forward_paths[path] += 1
        return logits
        # END EXERCISE
