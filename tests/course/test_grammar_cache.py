"""Stage 11's cache of compiled grammars is bounded: a client that sends ever new schemas or
regexes cannot grow the scheduler without end (unbounded, as measured on SmolLM2's tokenizer, 300
small regexes held 13.9 MiB, 48 KiB each, and each 668k-character alternation 23.3 MiB, for good).
Least recently used goes first; a Future a request already holds still resolves after its key is
evicted."""

from __future__ import annotations

from concurrent.futures import Future

from transformers import AutoTokenizer

from s11_structured_output.grammar_backend import GrammarBackend, GrammarCache


def test_the_least_recently_used_grammar_goes_first_past_the_count():
    cache = GrammarCache(max_grammars=3, max_chars=10**6)
    keys = [("regex", f"a{i}") for i in range(4)]
    for key in keys[:3]:
        cache[key] = Future()
    assert cache.get(keys[0]) is not None  # used again: now the most recent
    cache[keys[3]] = Future()
    assert len(cache) == 3
    assert keys[1] not in cache, "the least recently used key should have been evicted"
    assert all(key in cache for key in (keys[0], keys[2], keys[3]))


def test_the_grammar_text_held_is_bounded_and_the_newest_always_stays():
    cache = GrammarCache(max_grammars=100, max_chars=10)
    cache[("regex", "aaaa")] = Future()
    cache[("json", "bbbb")] = Future()
    assert len(cache) == 2 and cache.chars == 8
    cache[("regex", "cccc")] = Future()  # 12 chars: the oldest goes
    assert ("regex", "aaaa") not in cache and cache.chars == 8
    big = ("regex", "x" * 50)  # alone over the bound: kept (its request is compiling it), the rest go
    cache[big] = Future()
    assert list(cache.entries) == [big] and cache.chars == 50
    cache[big] = Future()  # the same key again is not counted twice
    assert cache.chars == 50


def test_an_evicted_grammar_compiles_again_and_a_held_future_still_resolves(tiny_models_root):
    path = tiny_models_root / "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(path)
    backend = GrammarBackend(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    backend.cache = GrammarCache(max_grammars=2)
    held = backend.get(("regex", "yes|no"))
    for text in ("a+", "b+", "c+"):
        backend.get(("regex", text)).result()
    assert ("regex", "yes|no") not in backend.cache and len(backend.cache) == 2
    assert held.result() is not None, "a request holding an evicted grammar's Future still gets its matcher"
    compiled = backend.compilations
    backend.get(("regex", "yes|no")).result()
    assert backend.compilations == compiled + 1, "a grammar the cache forgot is compiled again"
    backend.get(("regex", "c+")).result()
    assert backend.compilations == compiled + 1, "a grammar still cached is not compiled again"
