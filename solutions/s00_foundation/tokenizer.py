"""Text <-> token ids, through the model's own Hugging Face tokenizer and chat template.

A chat's control tokens (``<|im_start|>``, ``<|im_end|>``, ...) mark whose turn is whose, so they
must come from the template alone: text in a message that spells one is tokenized as text, as the
characters it is, never as the token. Otherwise a user's message could end its own turn and forge
a system or assistant turn after it (transformers' own ``apply_chat_template`` lets it through).
A plain text prompt is the model's raw input and keeps them: that is how a client writes its own
template.
"""

from __future__ import annotations

import json
import re
import secrets
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence, Union

from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .loader import resolve_model_path

Messages = list[dict[str, Any]]  # {"role", "content", ...}; a tool call's fields hold dicts and lists
Prompt = Union[str, Messages]


class Tokenizer:
    def __init__(self, model_path: str | Path):
        folder = resolve_model_path(model_path)
        self.hf = AutoTokenizer.from_pretrained(str(folder))
        self.eos_token_ids = _eos_token_ids(folder, self.hf)
        # The added tokens flagged special are the control tokens; longest first, so that one that
        # holds another is matched whole.
        special = {t.content for t in self.hf.added_tokens_decoder.values() if t.special}
        # ...and their ids: what decode() leaves out of a text (skip_special_tokens, as an answer's is)
        self.control_ids = frozenset(i for i, t in self.hf.added_tokens_decoder.items() if t.special)
        controls = sorted(special, key=len, reverse=True)
        self.control_tokens = re.compile("(" + "|".join(map(re.escape, controls)) + ")") if controls else None
        # A byte-level vocabulary (GPT-2's, SmolLM2's, Qwen's, Llama 3's) spells each byte as one
        # printable character; this maps them back (token_pieces). None: the vocabulary is not byte-level.
        byte_level = type(self.hf.backend_tokenizer.decoder).__name__ == "ByteLevel"
        self.byte_of_char = {c: b for b, c in bytes_to_unicode().items()} if byte_level else None
        self.pieces: dict[int, tuple[str, bytes]] = {}  # token_pieces' answers so far (at most the vocabulary)

    @property
    def is_chat(self) -> bool:
        return bool(self.hf.chat_template)

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template writes a request's tools itself (it reads ``tools``)."""
        template = self.hf.chat_template
        return isinstance(template, str) and "tools" in template

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text)["input_ids"])

    def apply_chat_template(
        self,
        messages: Messages,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        check_text: Callable[[str], None] | None = None,
    ) -> list[int]:
        """The messages (and ``tools``, for a template that knows them) through the chat template.
        ``check_text``, if given, sees the rendered text before it is tokenized, and may refuse it
        by raising (a server counts a long text a window at a time: stage 9's ``check_fits``)."""
        if not self.is_chat:
            raise ValueError("this model's tokenizer has no chat template; send a plain text prompt")
        if not messages:
            raise ValueError("messages must hold at least one message")
        render = partial(
            self.hf.apply_chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        pattern = self.control_tokens
        if pattern is None or not any(pattern.search(text) for text in _texts([_said(m) for m in messages] + [tools])):
            # rendered once, then tokenized as transformers' apply_chat_template(tokenize=True) does
            text = render()
            if check_text is not None:
                check_text(text)
            return list(self.hf(text, add_special_tokens=False)["input_ids"])
        if check_text is not None:  # (rare: a message spells a control token; the text is rendered marked below)
            check_text(render())
        return self._chat_ids_with_control_text(messages, add_generation_prompt, tools)

    def _chat_ids_with_control_text(
        self, messages: Messages, add_generation_prompt: bool, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Render the template with a marker in place of each control token the messages (or the
        tools) spell, so that every control token left in the text is the template's own; then
        tokenize it the way the tokenizer does, in pieces split at those tokens, each piece with
        its markers put back as the text they stand for and read as text (``split_special_tokens``)."""
        pattern = self.control_tokens
        assert pattern is not None
        tag = marker_tag()
        spelled: list[str] = []

        def mark(text: str) -> str:
            def one(found: re.Match) -> str:
                spelled.append(found.group())
                return marker(tag, len(spelled) - 1)

            return pattern.sub(one, text)

        marked = [{**m, **_map_texts(_said(m), mark)} for m in messages]
        text = self.hf.apply_chat_template(
            marked, tools=_map_texts(tools, mark), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        markers = re.compile(rf"\[\[{tag}:(\d+)\]\]")
        ids: list[int] = []
        as_marked: list[int] = []
        for i, piece in enumerate(pattern.split(text)):  # text, control token, text, ..., text
            if i % 2:
                ids.append(self.hf.convert_tokens_to_ids(piece))
                as_marked.append(ids[-1])
            elif piece:
                as_marked += self.hf(piece, add_special_tokens=False)["input_ids"]
                piece = markers.sub(lambda found: spelled[int(found.group(1))], piece)
                ids += self.hf(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        # Splitting at the control tokens is what the tokenizer does itself, unless a control token
        # also eats the spaces around it (an added token's lstrip / rstrip): then the pieces differ
        # from its own reading, and this prompt is refused rather than tokenized another way.
        if as_marked != self.hf(text, add_special_tokens=False)["input_ids"]:
            raise ValueError(
                f"a message spells this model's control token {spelled[0]!r}, which its tokenizer cannot "
                "read as text inside a chat; leave it out of the messages"
            )
        return ids

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

    def token_pieces(self, ids: Sequence[int]) -> list[tuple[str, bytes]]:
        """Each token's own text and the exact bytes it stands for (what a log-probability names).

        One token may hold part of a UTF-8 character ("é" is two tokens in a byte-level
        vocabulary): its text then shows U+FFFD, its bytes are exact, and the bytes of consecutive
        tokens joined are the output's text. A control token is its own text ("<|im_end|>"); an id
        past the tokenizer (a vocabulary padded for the GPU) is ("", b"")."""
        missing = [t for t in dict.fromkeys(ids) if t not in self.pieces]
        for token_id, raw in zip(missing, self.hf.convert_ids_to_tokens(missing)):
            if raw is None:
                data = b""
            elif (
                self.byte_of_char is not None
                and raw not in self.hf.added_tokens_encoder
                and all(c in self.byte_of_char for c in raw)
            ):
                data = bytes(self.byte_of_char[c] for c in raw)
            else:
                data = self.hf.decode([token_id], skip_special_tokens=False).encode()
            self.pieces[token_id] = (data.decode("utf-8", errors="replace"), data)
        return [self.pieces[t] for t in ids]


def marker_tag() -> str:
    """A fresh tag for markers rendered through a chat template: digits, which no template filter
    (trim, upper, tojson) changes, and too many for a message to hold them by chance."""
    return str(secrets.randbelow(10**12)).zfill(12)


def marker(tag: str, index: int) -> str:
    """The marker that stands for item ``index`` while a template renders (tag: ``marker_tag()``)."""
    return f"[[{tag}:{index}]]"


def _said(message: dict[str, Any]) -> dict[str, Any]:
    """What a message says in words: every field but its role."""
    return {k: v for k, v in message.items() if k != "role"}


def _texts(value) -> list[str]:
    """Every string inside a JSON value (not its keys)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _texts(v)]
    return []


def _map_texts(value, change: Callable[[str], str]):
    """``value`` with ``change`` applied to every string inside it (the keys stay as they are)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {k: _map_texts(v, change) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_texts(v, change) for v in value]
    return value


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
