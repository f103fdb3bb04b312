"""Incremental detokenization: turn a growing list of token ids into text, a piece per step.

Two traps make "decode the new token alone" wrong:

- One character can take several tokens. With a byte-level vocabulary "é" is two tokens and
  "。" three; decoding only the first byte gives U+FFFD (the replacement character). So text
  is only released once it no longer ends in U+FFFD; until then the tokens stay pending.
- Some tokenizers decode a token differently depending on what precedes it (SentencePiece
  drops the leading space of the first token of a decode call). So each step re-decodes a few
  already-released tokens as context, and keeps only what the new tokens add to that text.

Each step decodes a handful of tokens, never the whole output: O(1) per step.
(The same algorithm is what SGLang's detokenizer runs; stage 9 streams text with it.)
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # everything released so far
        self.surr_offset = 0  # ids[surr_offset:read_offset] are re-decoded as context
        self.read_offset = 0  # ids[:read_offset] are already part of self.text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, ids: Sequence[int]) -> str:
        """Given all ids so far (a list that only grows), release and return the new text.

        Returns "" while the newest tokens do not yet make complete characters.
        """
        context = self._decode(ids[self.surr_offset : self.read_offset])
        with_new = self._decode(ids[self.surr_offset :])
        if len(with_new) <= len(context) or with_new.endswith(REPLACEMENT_CHAR):
            return ""  # nothing printable yet (a special token, or half a character)
        delta = with_new[len(context) :]
        self.text += delta
        self.surr_offset, self.read_offset = self.read_offset, len(ids)
        return delta

    def flush(self, ids: Sequence[int]) -> str:
        """All the text of ``ids``: what was released plus the pending tail, even if that tail
        is an unfinished character (used once the request is over and nothing more will come)."""
        context = self._decode(ids[self.surr_offset : self.read_offset])
        with_new = self._decode(ids[self.surr_offset :])
        return self.text + with_new[len(context) :]
