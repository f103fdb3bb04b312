"""``TPCausalLM``: the foundation's decoder (s00 model.py) built from the parallel layers.

Per decoder layer, on every rank::

    x ─ norm ─ qkv_proj (column: this rank's q, k, v heads) ─ RoPE ─ attention over its heads
      ─ o_proj (row) ─ ALL-REDUCE ─ + x ─ norm ─ gate_up_proj (column) ─ silu(gate)*up
      ─ down_proj (row) ─ ALL-REDUCE ─ + x

Two all-reduces per layer, one more for the embedding, and one gather of the logits: that is
all the communication of a forward pass. Norms, RoPE and residuals run on every rank on the
full hidden state (each rank holds the same copy after each all-reduce).

``model.config`` is the config as one rank sees it: its own numbers of query and KV heads (so
stage 4's KV pool, built from the config, holds only this rank's KV heads); the checkpoint's
full config is ``model.full_config``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from s00_foundation.config import ModelConfig
from s00_foundation.forward_batch import ForwardBatch
from s00_foundation.model import DecoderLayer, DecoderLM, RMSNorm
from s00_foundation.rope import RotaryEmbedding, apply_rotary

from .layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    head_ranges,
    split,
)
from .parallel_state import TPGroup


def rank_config(config: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The config one rank sees: its own query and KV heads (``head_ranges``). Raises ValueError
    for a model that does not split into ``tp.size`` equal parts (its heads, or its MLP)."""
    q, kv = head_ranges(config.num_attention_heads, config.num_key_value_heads, tp)
    if config.intermediate_size % tp.size:
        raise ValueError(
            f"intermediate_size={config.intermediate_size} does not divide by tp_size={tp.size}: each rank's MLP "
            "must hold an equal slice"
        )
    return replace(config, num_attention_heads=len(q), num_key_value_heads=len(kv))


class TPAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        d = self.head_dim = config.head_dim
        q, kv = head_ranges(config.num_attention_heads, config.num_key_value_heads, tp)
        self.num_heads, self.num_kv_heads = len(q), len(kv)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [
                Shard("q_proj", 0, q.start * d, q.stop * d),
                Shard("k_proj", 0, kv.start * d, kv.stop * d),
                Shard("v_proj", 0, kv.start * d, kv.stop * d),
            ],
            bias=config.qkv_bias,
        )
        self.o_proj = RowParallelLinear("o_proj", config.num_attention_heads * d, config.hidden_size, config.o_bias, tp)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.reshape(t, self.num_heads, d)
        k, v = k.reshape(t, self.num_kv_heads, d), v.reshape(t, self.num_kv_heads, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = batch.attn_backend.forward(q, k, v, self.layer_id, batch)  # this rank's heads, its KV pool
        return self.o_proj(out.reshape(t, self.num_heads * d))


class TPMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        part = split(config.intermediate_size, tp)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [Shard("gate_proj", 0, part.start, part.stop), Shard("up_proj", 0, part.start, part.stop)],
            bias=config.mlp_bias,
        )
        self.down_proj = RowParallelLinear(
            "down_proj", config.intermediate_size, config.hidden_size, config.mlp_bias, tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TPDecoderStack(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding("embed_tokens", config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, TPAttention(config, i, tp), TPMLP(config, tp))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TPCausalLM(DecoderLM):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.full_config, self.tp = config, tp
        self.config = rank_config(config, tp)
        self.model = TPDecoderStack(config, tp)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        # A tied head shares the embedding's parameter (its rows, split the same way): loaded once.
        self.lm_head = ParallelLMHead("lm_head", config.vocab_size, config.hidden_size, tp, tied)
        self.rotary = RotaryEmbedding(config)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits on rank 0 (the gather of every rank's slice of the vocabulary); None on
        the other ranks. The rest of the forward is the foundation's (s00 ``DecoderLM``)."""
        return self.lm_head(x)
