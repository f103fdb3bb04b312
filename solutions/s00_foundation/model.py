"""A Llama-family decoder in plain PyTorch (Llama / SmolLM2, Llama 3, Qwen2, Qwen3).

The module names mirror Hugging Face's (``model.layers.3.self_attn.q_proj``) so a checkpoint's
safetensors load without renaming. Two things differ from ``transformers`` on purpose:

- the input is one flattened ragged row of tokens described by a ``ForwardBatch``, not a padded
  ``[batch, seq]`` tensor, so requests of any lengths share a pass without padding;
- attention is delegated to ``batch.attn_backend``, which owns the KV storage; the model itself
  holds no cache and no per-batch state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_ops
from .config import ModelConfig
from .forward_batch import ForwardBatch, ForwardMode
from .linear import Linear, PackedWeight, linear, linear_group
from .rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.applies(x):  # a CPU pass: the same math in one loop (cpu_ops.py)
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 even for bfloat16 activations: the mean of squares loses too much in 8 bits.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)
        self.gate_up_packed = PackedWeight()  # gate and up as one product (linear.py: linear_group)

    def packed_products(self) -> list[tuple[PackedWeight, tuple[torch.Tensor, ...]]]:
        """The prepacked copies forward() multiplies by, and their weights (linear.py: prepack)."""
        return [
            (self.gate_up_packed, (self.gate_proj.weight, self.up_proj.weight)),
            (self.down_proj.packed, (self.down_proj.weight,)),
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_group(x, (self.gate_proj, self.up_proj), self.gate_up_packed)
        if cpu_ops.applies(gate):  # a CPU pass: silu(gate) * up in one loop (cpu_ops.py)
            return self.down_proj(cpu_ops.silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        h = config.hidden_size
        self.q_proj = Linear(h, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.o_bias)
        self.qkv_packed = PackedWeight()  # q, k and v as one product (linear.py: linear_group)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def packed_products(self) -> list[tuple[PackedWeight, tuple[torch.Tensor, ...]]]:
        """The prepacked copies forward() multiplies by, and their weights (linear.py: prepack)."""
        return [
            (self.qkv_packed, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)),
            (self.o_proj.packed, (self.o_proj.weight,)),
        ]

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = linear_group(x, (self.q_proj, self.k_proj, self.v_proj), self.qkv_packed)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = batch.attn_backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, self_attn: nn.Module | None = None, mlp: nn.Module | None = None
    ):
        """``self_attn`` and ``mlp``: other blocks of the same shape (stage 12's tensor-parallel
        ones); by default this file's."""
        super().__init__()
        self.self_attn = self_attn if self_attn is not None else Attention(config, layer_id)
        self.mlp = mlp if mlp is not None else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Embedding, the decoder layers and the final norm (``model.*`` in a checkpoint)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # Given its weight, nn.Embedding skips its random init: the checkpoint's weights replace it
        # anyway (loader.py builds the model on the meta device), and that init on the meta device
        # imports torch._dynamo, ~2 s at the start of every process that builds a model.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderLM(nn.Module):
    """What every decoder model here shares: a ``model`` (embedding, layers, norm), ``rotary``,
    and the forward over a ForwardBatch; subclasses build them and say how logits are computed
    (stage 12 builds the same shape from tensor-parallel layers)."""

    model: nn.Module
    rotary: RotaryEmbedding

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def compute_logits(self, x: torch.Tensor):
        """Float32 logits from the final hidden states."""
        raise NotImplementedError(f"{type(self).__name__} must say how its logits are computed (compute_logits)")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, return_all_logits: bool = False):
        """Run the batch's new tokens through the decoder.

        Returns float32 logits ``[num_reqs, vocab]`` at each request's last new token (the only
        place a next token is sampled from), then one row per ``batch.extra_logit_rows`` entry
        (``[num_reqs + len(extra_logit_rows), vocab]``); or ``[T, vocab]`` for every token when asked.
        """
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch)
        if not return_all_logits:
            rows = None  # a decode's rows are its last tokens
            if batch.forward_mode is not ForwardMode.DECODE:
                rows = torch.tensor(batch.extend_lens, device=x.device).cumsum(0) - 1
            if batch.extra_logit_rows:
                last = rows if rows is not None else torch.arange(x.shape[0], device=x.device)
                rows = torch.cat([last, torch.tensor(batch.extra_logit_rows, device=x.device)])
            if rows is not None:
                x = x[rows]
        return self.compute_logits(self.model.norm(x))


class CausalLM(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        # Tied models reuse the embedding matrix as the output projection: no lm_head of their own.
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied_logits_packed = PackedWeight()  # the embedding matrix, prepacked as an output projection
        self.rotary = RotaryEmbedding(config)

    def packed_products(self) -> list[tuple[PackedWeight, tuple[torch.Tensor, ...]]]:
        """The output projection's prepacked copy and its weight (linear.py: prepack)."""
        if self.lm_head is not None:
            return [(self.lm_head.packed, (self.lm_head.weight,))]
        return [(self.tied_logits_packed, (self.model.embed_tokens.weight,))]

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(x).float()
        return linear(x, self.model.embed_tokens.weight, None, self.tied_logits_packed).float()
