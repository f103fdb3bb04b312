"""A model's shape, read from a Hugging Face ``config.json`` into one small dataclass.

Only the Llama family is supported (Llama / SmolLM2, Llama 3, Qwen2, Qwen3): they share one
decoder and differ in a few switches that this file spells out: biases on q/k/v (Qwen2),
RMSNorm on q and k (Qwen3), RoPE scaling (Llama 3) and tied embeddings (small models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama with attention_bias)
    o_bias: bool  # the output projection carries a bias (Llama with attention_bias)
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {"rope_type": ..., ...}
    eos_token_ids: tuple[int, ...] = ()

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's K and V occupy across all layers: 2 x layers x kv_heads x head_dim x itemsize."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; this engine runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama, SmolLM2, Llama 3, Qwen2, Qwen3)."
            )
        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported (use_sliding_window=true).")
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        theta, scaling = _rope_settings(raw)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=raw["rms_norm_eps"],
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no switch for it).
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_theta=theta,
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model folder needs a Hugging Face config.json")
        return cls.from_dict(json.loads(path.read_text()))


def _rope_settings(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """RoPE base and scaling, from either config style.

    transformers 5 writes ``rope_parameters = {"rope_type", "rope_theta", ...}``; older configs
    (and most on the hub) write ``rope_theta`` plus an optional ``rope_scaling`` dict.
    """
    params = raw.get("rope_parameters")
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        params = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return float(theta), ({"rope_type": rope_type, **params} if rope_type != "default" else {})
