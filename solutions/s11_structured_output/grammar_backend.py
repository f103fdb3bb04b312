"""``GrammarBackend``: compiles grammars in the background, once per schema; ``Grammar``: one
request's matcher.

The library is llguidance (Microsoft's, one of SGLang's and vLLM's backends; the README says why
it and not xgrammar or outlines-core). It gives us three things, and the engine does the rest:

    compile      a JSON schema or a regex -> an ``LLMatcher`` over the model's vocabulary
    mask         the matcher's state -> a bitmask, one bit per token id: may it come next?
    advance      consume_token(t) after t was sampled; rollback(n) undoes the last n tokens

Compiling takes from a millisecond to, for a hostile schema, seconds, so it never runs on the
scheduler's thread: ``get`` returns a Future from a thread pool, and a cache keyed by
(kind, text) means each distinct schema compiles once (a bounded cache: ``GrammarCache``). A
request gets its own matcher by copying the compiled one (``deep_copy``: cheap), because every
request is at its own place in the grammar.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

import llguidance
import llguidance.hf
import llguidance.numpy
import torch

from .grammar_check import PARSER_LIMITS, GrammarError, GrammarMemory, grammar_text, kind_name
from .sampling_params import GrammarKey

COMPILE_THREADS = 2  # grammars compiled at once (llguidance drops the GIL while it compiles)
# How much the cache of compiled grammars keeps (GrammarCache). A compiled grammar measured ~48 KB
# plus ~35 bytes per character of its text (SmolLM2's 49k vocabulary), so at most ~12 + 35 MB.
CACHE_MAX_GRAMMARS = 256
CACHE_MAX_CHARS = 1_000_000


def library_reason(reason: str) -> str:
    """llguidance's reason in a client's words: its advice to raise one of its limits is for
    whoever runs the server, and "NoExtensionBias" says only that no token may come."""
    if "NoExtensionBias" in reason:
        return (
            "no token can come next: the grammar matches no text the model can write "
            "(is it empty, or endlessly self-referential?)"
        )
    if "limits." in reason or "too many" in reason.lower():
        return f"{reason.split(';')[0]}: the grammar is too large or complex for this server's limits; simplify it"
    return reason


class Grammar:
    """One request's place in its grammar. ``num_tokens`` counts what it consumed, so retraction
    can roll it back to the tokens the request keeps."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.num_tokens = 0
        self.failure: str | None = None  # why the library gave up on this grammar (see accept_token)

    def accept_token(self, token_id: int) -> None:
        """The sampled token moves the grammar on. The mask allowed only tokens the grammar
        accepts, so a token it forbids is a bug (a mask applied to the wrong row), never the
        model's fault: that raises. The library may also give up on an allowed token, when
        matching it would pass one of its limits (a regex such as a{1000000}): then ``failure``
        says why, and the scheduler ends this request alone, with that error."""
        if not self.matcher.is_error():  # else it gave up while filling this step's mask
            allowed = self.matcher.validate_tokens([token_id]) == 1  # (an EOS that ends it counts 0 here)
            if self.matcher.consume_token(token_id):
                self.num_tokens += 1
                return
            if not allowed:
                raise RuntimeError(
                    f"the grammar refused token {token_id}, which its mask should have forbidden: is the bitmask "
                    "unpacked with bit j of word w = token 32*w + j, and applied to the row of its own request?"
                )
        reason = self.matcher.get_error().split("\n")[0]  # (what follows is the parser's debug dump)
        self.failure = f"the grammar library gave up on this grammar: {library_reason(reason)}"

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens of the next step into ``bitmask[row]`` (int32, 32 tokens per
        word, bit j of word w is token 32*w + j)."""
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(
                f"bitmask row {row} of {bitmask.shape[0]}: the bitmask has one row per constrained request "
                "(the i-th constrained request of the batch fills row i), not one per row of the batch"
            )
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask.numpy(), row)  # the tensor's own memory

    def rollback_to(self, num_tokens: int) -> None:
        """Undo consumed tokens until only the first ``num_tokens`` remain."""
        # BEGIN EXERCISE: roll the matcher back to the tokens the request keeps [#retraction-and-abort]
        if num_tokens < self.num_tokens:
            if not self.matcher.rollback(self.num_tokens - num_tokens):
                raise RuntimeError(f"the grammar could not roll back to {num_tokens} tokens")
            self.num_tokens = num_tokens
        # END EXERCISE


class GrammarCache(GrammarMemory[Future]):
    """The compiled grammars (Futures) by key, bounded (GrammarMemory). Unbounded, a client that
    sends ever new schemas would grow the process until it runs out of memory. A request that
    already holds an evicted grammar's Future keeps it; the cache only forgets it."""

    def __init__(self, max_grammars: int = CACHE_MAX_GRAMMARS, max_chars: int = CACHE_MAX_CHARS):
        super().__init__(max_grammars, max_chars)


class GrammarBackend:
    """Compiles grammars for one model's vocabulary on a thread pool, each distinct one once."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int], threads: int = COMPILE_THREADS):
        """``vocab_size``: the model's logits width (often padded past the tokenizer's ids: those
        tokens are never allowed). ``eos_token_ids``: the tokens that end a request; the grammar
        allows them once it is complete."""
        # The tokenizer bridge walks the whole vocabulary once (~0.4 s for a 49k vocabulary).
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.cache = GrammarCache()  # each distinct grammar compiled once, while it stays cached
        self.lock = threading.Lock()  # get() may be called from several threads (a server's)
        self.compilations = 0  # how many grammars were compiled: each distinct key once

    def compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        """The compiled matcher of ``key`` at its start (runs on the pool). Raises GrammarError."""
        self.compilations += 1
        matcher = llguidance.LLMatcher(
            self.tokenizer, grammar_text(key), log_level=0, limits=llguidance.LLParserLimits(**PARSER_LIMITS)
        )
        if matcher.is_error():
            raise GrammarError(f"invalid {kind_name(key)}: {library_reason(matcher.get_error())}")
        return matcher

    def get(self, key: GrammarKey) -> Future:
        """A Future of ``key``'s compiled matcher: the cached one, or a compilation started now on
        the pool. Never blocks. A failed compilation stays cached too (the same schema fails the same way).
        The cache is bounded (GrammarCache): a grammar it has forgotten is compiled again."""
        # BEGIN EXERCISE: one compilation per key, off the caller's thread [#compiling-in-the-background]
        with self.lock:
            future = self.cache.get(key)
            if future is None:
                future = self.cache[key] = self.executor.submit(self.compile, key)
            return future
        # END EXERCISE

    def new_grammar(self, compiled: llguidance.LLMatcher) -> Grammar:
        """A request's own matcher, at the grammar's start."""
        return Grammar(compiled.deep_copy())
