"""Tiny random models of every supported family, built locally in well under a second.

Each is a real Hugging Face folder (config.json, model.safetensors, tokenizer files with a chat
template), so the engine and ``transformers`` load exactly the same thing. The tokenizer is
byte-level: every UTF-8 byte is one token, which makes multi-byte characters and stop strings
that span several tokens easy to provoke.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from transformers.utils import logging as hf_logging

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "llama_gqa_bias")
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
BOS_ID, EOS_ID = 256, 257  # <|im_start|>, <|im_end|>
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=EOS_ID,
)

# 8 query heads share 1 KV head (8:1 GQA); head_dim 24 is not hidden_size / heads (8); every
# projection has a bias (Llama's attention_bias and mlp_bias: the only path through o_proj's
# bias); a vocabulary padded past the tokenizer's 259 ids, as real checkpoints often are.
ODD_SHAPE = dict(num_attention_heads=8, num_key_value_heads=1, head_dim=24, intermediate_size=96, vocab_size=320)


def family_config(family: str):
    if family == "llama":  # SmolLM2-like: tied embeddings, plain RoPE
        return LlamaConfig(**_SHAPE, tie_word_embeddings=True, rope_theta=10000.0)
    if family == "llama3":  # Llama 3.1-like: untied, llama3 RoPE scaling with all three frequency bands in use
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
            rope_theta=500000.0,
        )
        return LlamaConfig(**_SHAPE, tie_word_embeddings=False, rope_parameters=scaling)
    if family == "qwen2":  # q/k/v biases
        return Qwen2Config(**_SHAPE, tie_word_embeddings=True, rope_theta=1000000.0)
    if family == "qwen3":  # RMSNorm on q and k
        return Qwen3Config(**_SHAPE, tie_word_embeddings=False, rope_theta=1000000.0)
    if family == "llama_gqa_bias":  # the shapes the others never take: see ODD_SHAPE
        return LlamaConfig(
            **{**_SHAPE, **ODD_SHAPE}, tie_word_embeddings=False, rope_theta=10000.0, attention_bias=True, mlp_bias=True
        )
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # Order the 256 byte symbols by the byte they stand for, so token id == byte value.
    order = sorted(byte_chars, key=_byte_of)
    vocab = {ch: i for i, ch in enumerate(order)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def _byte_of(ch: str) -> int:
    # GPT-2's byte-to-unicode map: printable bytes map to themselves, the rest to 256 + k.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def build_tiny_model(family: str, folder: Path, seed: int = 0) -> Path:
    """Write a seeded random ``family`` model with the byte tokenizer into ``folder``."""
    hf_logging.disable_progress_bar()  # "Writing model shards" bars would clutter every failure report
    torch.manual_seed(seed + FAMILIES.index(family))
    config = family_config(family)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers initialises biases to 0 and norms to 1, which would hide a missing
            # bias or q/k norm; random values make every part of the architecture matter.
            # The scale keeps logits spread out so greedy picks have clear margins.
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.25)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return folder
