"""The tokenizer wrapper: chat template, EOS ids, byte-level round trips (not graded)."""

from __future__ import annotations

from reference import engine_tokenizer
from tiny_models import BOS_ID, EOS_ID


def test_chat_prompt_uses_the_template(tiny_models_root):
    tok = engine_tokenizer(str(tiny_models_root / "llama"))
    ids = tok.encode_prompt("hi")
    assert ids[0] == BOS_ID and ids[-len(b"assistant\n") :] == list(b"assistant\n")
    assert tok.encode_prompt([{"role": "user", "content": "hi"}]) == ids
    assert tok.eos_token_ids == [EOS_ID]


def test_multibyte_text_round_trips(tiny_models_root):
    tok = engine_tokenizer(str(tiny_models_root / "qwen3"))
    text = "naïve café 你好 🙂"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text


def test_default_model_chat_template(default_model_dir):
    tok = engine_tokenizer(str(default_model_dir))
    text = tok.decode(tok.encode_prompt("What is 2+2?"), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert 2 in tok.eos_token_ids  # <|im_end|>
