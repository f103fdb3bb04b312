"""The provided model agrees with transformers (not graded: this code is given, not written)."""

from __future__ import annotations

import json

import pytest
import torch

from reference import engine_model, hf_model
from s00_foundation.attention import NoCacheBackend
from s00_foundation.config import ModelConfig
from s00_foundation.forward_batch import ForwardBatch, ForwardMode
from s00_foundation.loader import load_model


def _all_logits(model, requests):
    batch = ForwardBatch.build(requests, [0] * len(requests), NoCacheBackend())
    return model(batch, return_all_logits=True)


def test_logits_match_transformers_on_every_family(tiny_model_dir):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (300,)).tolist()  # long enough to reach llama3's scaled RoPE band
    with torch.no_grad():
        expected = hf_model(str(tiny_model_dir))(torch.tensor([ids])).logits[0]
    got = _all_logits(engine_model(str(tiny_model_dir)), [ids])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_ragged_batch_equals_requests_one_by_one(tiny_model_dir):
    model = engine_model(str(tiny_model_dir))
    requests = [[1, 2, 3], [7], list(range(40, 60))]
    together = _all_logits(model, requests)
    alone = torch.cat([_all_logits(model, [r]) for r in requests])
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)


def test_default_model_matches_transformers(default_model_dir):
    ids = list(range(100, 180))
    with torch.no_grad():
        expected = hf_model(str(default_model_dir))(torch.tensor([ids])).logits[0, -1]
    got = engine_model(str(default_model_dir))(ForwardBatch.build([ids], [0], NoCacheBackend()))[0]
    torch.testing.assert_close(got, expected, atol=5e-4, rtol=1e-4)


def test_config_reads_each_family_switch(tiny_models_root):
    configs = {f: ModelConfig.from_folder(tiny_models_root / f) for f in ("llama", "llama3", "qwen2", "qwen3")}
    assert configs["llama"].tie_word_embeddings and not configs["llama3"].tie_word_embeddings
    assert configs["llama3"].rope_scaling["rope_type"] == "llama3"
    assert configs["qwen2"].qkv_bias and not configs["qwen2"].o_bias
    assert configs["qwen3"].qk_norm and not configs["llama"].qk_norm


def test_config_reads_hub_style_rope_keys():
    raw = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 500000.0 and config.rope_scaling["factor"] == 8.0
    assert config.num_key_value_heads == 2 and config.head_dim == 4


def test_kv_bytes_per_token_formula():
    raw = {
        "model_type": "qwen3",
        "vocab_size": 10,
        "hidden_size": 1024,
        "intermediate_size": 16,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
    }
    # Qwen3-0.6B: 2 (K and V) x 28 layers x 8 KV heads x 128 dims x 2 bytes = 112 KiB per token.
    assert ModelConfig.from_dict(raw).kv_bytes_per_token(torch.bfloat16) == 2 * 28 * 8 * 128 * 2


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        load_model(tmp_path)


def test_forward_batch_positions_continue_after_the_prefix():
    batch = ForwardBatch.build([[5, 6], [9]], [3, 0], NoCacheBackend())
    assert batch.positions.tolist() == [3, 4, 0]
    assert batch.seq_lens == [5, 1] and batch.prefix_lens == [3, 0]
    assert batch.forward_mode is ForwardMode.EXTEND
    assert ForwardBatch.build([[1], [2]], [4, 7], NoCacheBackend()).forward_mode is ForwardMode.DECODE
    assert ForwardBatch.build([[1], [2, 3]], [4, 0], NoCacheBackend()).forward_mode is ForwardMode.MIXED


def test_no_cache_backend_refuses_a_prefix(tiny_models_root):
    model = engine_model(str(tiny_models_root / "llama"))
    with pytest.raises(ValueError, match="whole sequence"):
        model(ForwardBatch.build([[1, 2]], [3], NoCacheBackend()))
