"""``ModelRunner``: the model plus the KV memory it runs against (SGLang's name and role).

It owns the two pools, the allocator and the attention backend, and runs one ForwardBatch at a
time. The schedulers of this and later stages decide WHAT runs; the runner only runs it.
"""

from __future__ import annotations

import torch

from s00_foundation.forward_batch import ForwardBatch
from s00_foundation.model import CausalLM

from .allocator import TokenToKVPoolAllocator
from .flash_backend import FlashAttentionBackend, flash_attn_available
from .memory_pool import ReqToTokenPool, TokenToKVPool
from .paged_backend import PagedAttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "flash")


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool_size: int,
        page_size: int = 1,
        max_running_requests: int = 64,
        max_context_len: int | None = None,
        attention_backend: str = "auto",
    ):
        """``pool_size`` usable KV slots (a multiple of ``page_size``), table rows for
        ``max_running_requests`` requests of up to ``max_context_len`` tokens (default: the
        model's max_position_embeddings)."""
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        self.model = model
        self.device = model.device
        self.page_size = page_size
        self.allocator = TokenToKVPoolAllocator(pool_size, page_size, device=self.device)
        self.token_to_kv_pool = TokenToKVPool.for_model(model, pool_size, page_size)
        self.req_to_token_pool = ReqToTokenPool(
            max_running_requests, max_context_len or model.config.max_position_embeddings, device=self.device
        )
        if attention_backend == "auto":
            use_flash = (
                flash_attn_available() and self.device.type == "cuda" and model.dtype in (torch.float16, torch.bfloat16)
            )
            attention_backend = "flash" if use_flash else "torch"
        backend_class = FlashAttentionBackend if attention_backend == "flash" else PagedAttentionBackend
        self.attn_backend = backend_class(self.req_to_token_pool, self.token_to_kv_pool)

    @property
    def attention_backend_name(self) -> str:
        return "flash-attn" if isinstance(self.attn_backend, FlashAttentionBackend) else "torch (gather + SDPA)"

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_reqs, vocab] at each request's last new token, then one row per entry of
        ``batch.extra_logit_rows`` (the prompt positions a request asked log-probabilities of)."""
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch)
