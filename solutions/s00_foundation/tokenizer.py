"""Text <-> token ids, through the model's own Hugging Face tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Union

from transformers import AutoTokenizer

from .loader import resolve_model_path

Messages = list[dict[str, str]]
Prompt = Union[str, Messages]


class Tokenizer:
    def __init__(self, model_path: str | Path):
        folder = resolve_model_path(model_path)
        self.hf = AutoTokenizer.from_pretrained(str(folder))
        self.eos_token_ids = _eos_token_ids(folder, self.hf)

    @property
    def is_chat(self) -> bool:
        return bool(self.hf.chat_template)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text)["input_ids"])

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        if not self.is_chat:
            raise ValueError("this model's tokenizer has no chat template; send a plain text prompt")
        if not messages:
            raise ValueError("messages must hold at least one message")
        encoded = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Messages go through the chat template; so does a plain string for a chat model
        (as one user turn), since that is how chat models were trained to be asked."""
        if isinstance(prompt, str):
            return (
                self.apply_chat_template([{"role": "user", "content": prompt}]) if self.is_chat else self.encode(prompt)
            )
        return self.apply_chat_template(list(prompt))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _eos_token_ids(folder: Path, hf) -> list[int]:
    """Every id that ends a turn: generation_config's, config's and the tokenizer's own EOS."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if hf.eos_token_id is not None:
        ids.append(hf.eos_token_id)
    return sorted(set(ids))
