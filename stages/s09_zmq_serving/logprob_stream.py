"""Log-probabilities on a stream: each token's entry goes out with its text, never before it.

For a request that asked (``SamplingParams.logprobs``), the scheduler sends each new token's
``TokenLogprob`` (stage 2) beside its id. The detokenizer turns it into what a client reads, a
``LogprobEntry``: the token's text and bytes, its log-probability, the likeliest tokens at its
place, and where its text starts in the answer. The text's two rules (detokenizer_manager.py)
decide when an entry may go::

    tokens      " Sure"  "!"  "\\n\\n"  "User"  ":"        stop = ["\\n\\nUser:"]
    text sent   " Sure!"                                 (held back: "\\n\\nUser" may be the stop)
    entries     " Sure"  "!"                             ("\\n\\n" and "User" wait with their text)
    at ":"      the stop string is complete: its tokens' entries are dropped with its text

- **An entry waits for its text.** A token holding half a character, or the start of what may
  become a stop string, has sent nothing yet; its entry waits until its text is sent.
- **Every generated token has its entry, as usage counts it**, even one the answer does not
  show: the stop token / EOS that ended it goes last, with no text, at the text's end (an
  evaluation harness that asks for one token after an echoed prompt counts on prompt + 1
  entries). Only the tokens wholly inside a matched stop string are dropped, with their text.
- **A control token inside the answer adds no text.** The text leaves out control tokens
  (``<|im_start|>``, decoded with skip_special_tokens, as vLLM and SGLang do); one the model
  wrote mid-answer keeps its entry (its log-probability counts) with the text it adds: "" and no
  bytes, as vLLM's. Its alternatives are named as usual: a control token there is news.

So an answer's entries line up with its text: each ``text_offset`` is where that token's text
starts, the entries streamed are exactly the entries of the whole answer, and the answer is the
tokens' bytes joined (up to a cut stop string).
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING, Sequence

from s00_foundation.tokenizer import Tokenizer
from s02_request_and_sampling.logprobs import TokenLogprob
from s02_request_and_sampling.req import FinishReason

from .io_struct import LogprobEntry, PromptEcho

if TYPE_CHECKING:  # only types: detokenizer_manager.py imports this module
    from .detokenizer_manager import DecodeStatus


class LogprobStream:
    """One request's entries not sent yet, and where each one's text lies once it is released."""

    def __init__(self, tokenizer: Tokenizer, base: int = 0):
        """``base``: where the answer starts in the choice's text (after an echoed prompt)."""
        self.tokenizer = tokenizer
        self.base = base
        self.waiting: list[TokenLogprob] = []  # in token order: the newest tokens of the output
        self.spans: list[tuple[int, int] | None] = []  # each waiting token's (start, end) in the text; None: unplaced
        self.placed_to = 0  # where the text of the tokens placed so far ends

    def step(
        self,
        status: DecodeStatus,
        new_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob],
        finish_reason: FinishReason | None,
    ) -> tuple[str, list[LogprobEntry]]:
        """``status.step`` over the new tokens, one at a time (so each token's text is placed),
        and the entries whose text has now been sent. Returns (text, entries)."""
        if len(logprobs) != len(new_ids):
            raise ValueError(
                f"{len(new_ids)} new token(s) came with {len(logprobs)} log-probabilities; expected one each"
            )
        text = ""
        for j, (token_id, logprob) in enumerate(zip(new_ids, logprobs)):
            text += status.step([token_id], finish_reason if j == len(new_ids) - 1 else None)
            self.waiting.append(logprob)
            self.spans.append(None)
            detok = status.detokenizer
            first = len(status.output_ids) - len(self.waiting)  # the output index of waiting[0]
            self.place(
                [k for k, span in enumerate(self.spans) if span is None and first + k < detok.read_offset],
                len(detok.text),
            )
        if not new_ids and finish_reason is not None:
            text += status.step([], finish_reason)
        if finish_reason is None:
            return text, self.release(sum(1 for span in self.spans if span is not None and span[1] <= status.sent))
        # The answer is complete, status.sent characters long: its unfinished tail is text now.
        self.place([k for k, span in enumerate(self.spans) if span is None], max(status.sent, self.placed_to))
        if isinstance(finish_reason.matched, int):  # a stop token / EOS: the last token is not text, yet counts
            shown = self.release(len(self.waiting) - 1)
            return text, shown + self.release_unshown(self.base + status.sent)
        if isinstance(finish_reason.matched, str):  # a stop string: the tokens that start before it
            keep = sum(1 for span in self.spans if span is not None and span[0] < status.sent)
        else:
            keep = len(self.waiting)
        return text, self.release(max(keep, 0))

    def place(self, group: list[int], end: int) -> None:
        """The waiting tokens ``group`` were released together (a character split over tokens):
        their text runs from where the text placed so far ends to ``end``. Inside it, each token
        starts where the UTF-8 decoding of the group's bytes before it has got to (half a
        character is not text yet, so "é" split in two starts at the first token's place)."""
        if not group:
            return
        pieces = [self.shown(self.waiting[k].token_id)[1] for k in group]
        for k, start in zip(group, text_starts(pieces, self.placed_to)):
            self.spans[k] = (min(start, end), end)
        self.placed_to = end

    def shown(self, token_id: int) -> tuple[str, bytes]:
        """What a token of the answer adds to its text: its own text and bytes, but nothing for a
        control token, which the text leaves out."""
        if token_id in self.tokenizer.control_ids:
            return "", b""
        return self.tokenizer.token_pieces([token_id])[0]

    def release_unshown(self, offset: int) -> list[LogprobEntry]:
        """The tokens still waiting, which the answer does not show (the stop token / EOS that
        ended it): their entries with no text, at ``offset`` (the text's end)."""
        entries = [
            LogprobEntry("", b"", logprob.logprob, offset, named_alternatives(self.tokenizer, logprob))
            for logprob in self.waiting
        ]
        self.waiting.clear()
        self.spans.clear()
        return entries

    def release(self, count: int) -> list[LogprobEntry]:
        """The first ``count`` waiting tokens leave as entries, in order. Once a request is over,
        the tokens left waiting are the ones its answer does not show; they go with the stream."""
        entries = []
        for logprob, span in zip(self.waiting[:count], self.spans[:count]):
            token, data = self.shown(logprob.token_id)
            assert span is not None, "only placed tokens are released"
            entries.append(
                LogprobEntry(
                    token, data, logprob.logprob, self.base + span[0], named_alternatives(self.tokenizer, logprob)
                )
            )
        del self.waiting[:count], self.spans[:count]
        return entries


def named_alternatives(tokenizer: Tokenizer, logprob: TokenLogprob) -> list[tuple[str, bytes, float]]:
    """The likeliest tokens at a place as (text, bytes, logprob), each named by its own text (a
    control token by its name)."""
    pieces = tokenizer.token_pieces([token_id for token_id, _ in logprob.top])
    return [(text, data, value) for (text, data), (_, value) in zip(pieces, logprob.top)]


def echo_prompt(tokenizer: Tokenizer, echo: PromptEcho) -> tuple[str, list[LogprobEntry]]:
    """A completion's echoed prompt (``echo``) as the model read it: its text, the tokens' bytes
    joined (a control token spelled out: it is part of what the client sent), and, when the
    request asked for log-probabilities, one entry per prompt token, the first with neither
    logprob nor alternatives (nothing precedes it; OpenAI's null)."""
    pieces = tokenizer.token_pieces(echo.input_ids)
    text = b"".join(data for _, data in pieces).decode("utf-8", errors="replace")
    if echo.logprobs is None:
        return text, []
    entries = []
    for i, ((token, data), at) in enumerate(zip(pieces, text_starts([data for _, data in pieces], 0))):
        scored = echo.logprobs[i - 1] if i else None
        if scored is None:
            entries.append(LogprobEntry(token, data, None, at, None))
        else:
            entries.append(LogprobEntry(token, data, scored.logprob, at, named_alternatives(tokenizer, scored)))
    return text, entries


def text_starts(pieces: Sequence[bytes], at: int) -> list[int]:
    """Where each of consecutive byte pieces starts in their text, which starts at ``at``: how far
    the UTF-8 decoding of the pieces before it has got (half a character is not text yet, so both
    halves of a split "é" start at one place)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    starts = []
    for data in pieces:
        starts.append(at)
        at += len(decoder.decode(data))
    return starts
