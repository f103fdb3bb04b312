"""Stage 7 (graded): memory stays consistent around half-prefilled requests.

After each chunk the request's K/V go to the prefix cache: with the radix cache its finished
chunks are in the tree (locked for it) and another request with the same prefix reuses them;
nothing is freed twice. A small pool retracts the half-prefilled request first, or its next chunk
waits for room; an abort frees it, and the pool and tree invariants hold after every step."""

from __future__ import annotations

import pytest
import torch

from chunked_helpers import assert_pool_free_after_tree, check_all, chunked_engine, greedy, random_prompt, run_checked
from invariants import capped_steps
from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy
from s04_paged_kv_pool.allocator import TokenToKVPoolAllocator
from s04_paged_kv_pool.memory_pool import PoolExhaustedError
from s07_chunked_prefill.engine import Engine
from s07_chunked_prefill.prefix_cache import ChunkedRadixCache


def test_cache_unfinished_req_moves_the_lock_and_frees_duplicates():
    allocator = TokenToKVPoolAllocator(64, page_size=1)
    cache = ChunkedRadixCache(allocator)
    # Another request already left tokens 1..4 in the tree.
    other = allocator.alloc_extend([0], [4], [0])
    cache.insert([1, 2, 3, 4], other)
    # Ours matched only [1, 2], then computed 3..7 itself (3 and 4 again: duplicates).
    match = cache.match_prefix([1, 2])
    cache.lock(match)
    own = allocator.alloc_extend([2], [7], [int(match.slots[-1])])
    slots = torch.cat([match.slots, own])
    free_before = allocator.available_size()
    new = cache.cache_unfinished_req([1, 2, 3, 4, 5, 6, 7], slots, match)
    assert new.cached_len == 7, (
        f"the tree should now hold all 7 computed tokens for the request, its match covers {new.cached_len}"
    )
    assert new.slots[:4].tolist() == other.tolist(), (
        f"tokens 1..4 were in the tree first, so the request must now read the tree's slots {other.tolist()}, "
        f"not {new.slots[:4].tolist()}"
    )
    assert new.slots[4:].tolist() == own[2:].tolist(), "tokens 5..7 keep the slots the request computed them in"
    assert allocator.available_size() == free_before + 2, (
        "the request's own slots of tokens 3 and 4 were duplicates and must be freed: "
        f"{allocator.available_size() - free_before} were"
    )
    assert cache.protected_size_ == 7 and cache.evictable_size_ == 0, (
        f"the new match must be locked (7 protected, 0 evictable tokens), the counters say "
        f"{cache.protected_size_} protected, {cache.evictable_size_} evictable"
    )
    cache.check()
    cache.cache_finished_req([1, 2, 3, 4, 5, 6, 7], new.slots, new, insert=True)
    assert cache.protected_size_ == 0 and cache.evictable_size_ == 7, (
        "after the request left, all 7 tokens are evictable"
    )
    cache.evict(64)
    assert allocator.available_size() == allocator.size, "evicting the tree must free every slot exactly once"


class EagerRadixCache(ChunkedRadixCache):
    """A radix cache under memory pressure: whatever becomes evictable is evicted at once. A real
    server may evict between any two calls (another request's allocation needs room), so code
    that is correct for the radix cache is correct for this one too."""

    def unlock(self, match):
        super().unlock(match)
        self.evict(self.evictable_size())


def test_cache_unfinished_req_locks_the_new_match_before_unlocking_the_old():
    allocator = TokenToKVPoolAllocator(64, page_size=1)
    cache = EagerRadixCache(allocator)
    tokens = list(range(1, 13))
    match = cache.match_prefix(tokens[:0])  # a fresh request matched nothing
    cache.lock(match)
    for start, end in ((0, 6), (6, 12)):  # two chunks
        last = int(match.slots[-1]) if match.cached_len else 0
        slots = torch.cat([match.slots, allocator.alloc_extend([start], [end], [last])])
        match = cache.cache_unfinished_req(tokens[:end], slots, match)
        what = (
            f"cache_unfinished_req after the chunk of tokens {start}..{end - 1}, with a cache that evicts "
            "whatever becomes evictable"
        )
        assert match.cached_len == end, (
            f"{what}: it returned a match of {match.cached_len} tokens; the request's new match is the tree's copy of "
            f"all {end} tokens it inserted (match_prefix after the insert), which replaces the match it was given"
        )
        freed = [s for s in match.slots.tolist() if not bool(allocator.page_allocated[s])]
        assert not freed and match.node in cache._all_nodes(), (
            f"{what}: the request's new match ({match.cached_len} tokens) was evicted from under it (slots "
            f"{freed[:6]} are free again): between unlocking the old match and locking the new one, its tokens were "
            "an unlocked leaf. Lock the new match BEFORE unlocking the old one"
        )
        assert cache.protected_size_ == end, (
            f"{what}: the request's {end} tokens must be locked, {cache.protected_size_} are"
        )
        cache.check()


def test_chunked_prefill_with_a_cache_that_evicts_at_once(tiny_models_root):
    path = tiny_models_root / "llama3"

    class EagerEngine(Engine):
        def make_prefix_cache(self):
            self.tree_cache = EagerRadixCache(self.runner.allocator)
            return self.tree_cache

    engine = EagerEngine(engine_model(str(path)), engine_tokenizer(str(path)), chunked_prefill_size=7, pool_size=256)
    prompts = [random_prompt(n, seed=n) for n in (30, 4, 19)]
    what = "llama3, chunked_prefill_size=7, a radix cache that evicts whatever becomes evictable at once"
    reqs = run_checked(engine, prompts, greedy(5), what)
    for i, (req, prompt) in enumerate(zip(reqs, prompts)):
        assert_same_tokens(req.output_ids, hf_greedy(path, prompt, 5), f"{what}: request {i} vs transformers")
    assert_pool_free_after_tree(engine, what)


def test_finished_chunks_are_reused_by_a_request_sharing_the_prefix(tiny_models_root):
    path = tiny_models_root / "llama"
    budget = 8
    engine, recorder = chunked_engine(path, budget, pool_size=1024)
    long_prompt = random_prompt(50, seed=5)
    twin = long_prompt[:40] + random_prompt(3, seed=6)
    what = f"llama, a 50-token prompt chunked by {budget}, then a request sharing its first 40 tokens"
    with torch.inference_mode():
        first = engine.add_request(long_prompt, greedy(4))
        for _ in range(4):  # chunks 0..31 done; the request is half prefilled
            engine.step()
            check_all(engine, what)
        assert engine.scheduler.chunked_req is first, (
            f"{what}: after 4 steps the long request should be half prefilled (32 of its 50 tokens computed, 8 per "
            "step): a prompt longer than what is left of the step's budget is cut there and continued next step"
        )
        in_tree = engine.tree_cache.total_size()
        assert in_tree >= 32, (
            f"{what}: after 4 chunks of 8 its 32 computed tokens should be in the tree, it holds {in_tree}"
        )
        second = engine.add_request(twin, greedy(4))
        for _ in capped_steps(engine):
            engine.step()
            check_all(engine, what)
    assert second.prefix_match is None and engine.scheduler.stats.cached_tokens >= 40, (
        f"{what}: the second request should find at least its 40 shared tokens cached; admitted requests found "
        f"{engine.scheduler.stats.cached_tokens} in all"
    )
    for req, prompt in ((first, long_prompt), (second, twin)):
        assert_same_tokens(req.output_ids, hf_greedy(path, prompt, 4), f"{what}: request {req.rid} vs transformers")
    assert_pool_free_after_tree(engine, what)


def test_small_pool_retracts_the_half_prefilled_request_and_recovers(tiny_models_root):
    path = tiny_models_root / "qwen3"
    prompts = [random_prompt(n, seed=n) for n in (6, 9, 70, 5, 40)]
    limits = [30, 25, 4, 30, 6]
    expected = [hf_greedy(path, prompt, n) for prompt, n in zip(prompts, limits)]
    for radix in (True, False):
        what = (
            "qwen3, pool of 128 slots, chunked_prefill_size=6, new_token_ratio=0, radix cache "
            f"{'on' if radix else 'off'}"
        )
        engine, _ = chunked_engine(path, 6, pool_size=128, new_token_ratio=0.0, enable_radix_cache=radix)
        retracted_mid_prefill = []
        original = engine.scheduler.retract_for_decode

        def watch(engine=engine, original=original, retracted_mid_prefill=retracted_mid_prefill):
            pending = engine.scheduler.chunked_req
            out = original()
            if pending is not None and pending in out:
                retracted_mid_prefill.append(pending.rid)
            return out

        engine.scheduler.retract_for_decode = watch
        reqs = run_checked(engine, prompts, [greedy(n) for n in limits], what)
        assert retracted_mid_prefill, (
            f"{what}: the workload is built to run short while a prompt is half prefilled, yet no half-prefilled "
            "request was retracted (were its chunks cut to the step's budget left? prefill_len)"
        )
        for i, (req, ref) in enumerate(zip(reqs, expected)):
            assert_same_tokens(req.output_ids, ref, f"{what}: request {i} vs transformers")
        assert_pool_free_after_tree(engine, what)


def test_a_chunk_waits_for_room_in_a_small_pool(tiny_models_root):
    path = tiny_models_root / "qwen3"
    prompts = [random_prompt(n, seed=n) for n in (6, 9, 30, 5, 3, 25, 4)]
    limits = [20, 12, 4, 15, 9, 5, 8]
    expected = [hf_greedy(path, prompt, n) for prompt, n in zip(prompts, limits)]
    for radix in (True, False):
        what = (
            "qwen3, pool of 48 slots, chunked_prefill_size=16, new_token_ratio=0, radix cache "
            f"{'on' if radix else 'off'}"
        )
        engine, _ = chunked_engine(path, 16, pool_size=48, new_token_ratio=0.0, enable_radix_cache=radix)
        try:
            reqs = run_checked(engine, prompts, [greedy(n) for n in limits], what)
        except PoolExhaustedError as error:
            pytest.fail(
                f"{what}: {error}. The pool ran dry in a step: a half-prefilled prompt's next chunk takes only the "
                "room left after what the running requests keep back (next_chunk_len; 0 means it waits a step), "
                "not the whole budget, and the waiting requests admitted after it count it as scheduled in this "
                "step (admit_waiting's scheduled)"
            )
        for i, (req, ref) in enumerate(zip(reqs, expected)):
            assert_same_tokens(req.output_ids, ref, f"{what}: request {i} vs transformers")
        assert_pool_free_after_tree(engine, what)


def test_aborting_a_half_prefilled_request_frees_it(tiny_models_root):
    path = tiny_models_root / "qwen2"
    for radix in (True, False):
        what = (
            f"qwen2, chunked_prefill_size=5, radix cache {'on' if radix else 'off'}: abort a 40-token prompt "
            "after 3 chunks"
        )
        engine, _ = chunked_engine(path, 5, pool_size=256, enable_radix_cache=radix)
        other_prompt = random_prompt(4, seed=4)
        with torch.inference_mode():
            long_req = engine.add_request(random_prompt(40, seed=40), greedy(5))
            for _ in range(3):
                engine.step()
            assert engine.scheduler.chunked_req is long_req, f"{what}: the long request should be half prefilled"
            assert engine.abort_request(long_req.rid), (
                f"{what}: abort_request returned False for the half-prefilled request"
            )
            assert not engine.abort_request(long_req.rid), (
                f"{what}: a second abort of the same request must return False"
            )
            assert long_req.finished_reason is not None and long_req.finished_reason.type == "abort"
            check_all(engine, what)
            assert not engine.has_work, f"{what}: after the abort nothing should be left to do"
            other = engine.add_request(other_prompt, greedy(5))
            for _ in capped_steps(engine):
                engine.step()
                check_all(engine, what)
        assert_same_tokens(
            other.output_ids, hf_greedy(path, other_prompt, 5), f"{what}: the next request vs transformers"
        )
        assert_pool_free_after_tree(engine, what)
