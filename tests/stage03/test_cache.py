"""Stage 3 (graded): what the cache holds - its length after each step, K/V that never change,
a prefill split in pieces, and growth by doubling."""

from __future__ import annotations

import pytest
import torch

from recording import PassRecorder
from reference import assert_same_tokens, engine_model, hf_greedy, hf_last_logits
from s03_kv_cache.generate import extend, stream_generate
from s03_kv_cache.kv_cache import KVCache

PROMPT = list(b"The quick brown fox jumps over the lazy dog.")


def close(got, expected, what):
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("eos_at", [None, 5], ids=["to max_new_tokens", "stopped by EOS"])
def test_cache_holds_prompt_plus_generated_minus_one_after_each_step(tiny_models_root, eos_at):
    path = tiny_models_root / "llama"
    model = engine_model(str(path))
    n = 12
    eos = [] if eos_at is None else [hf_greedy(path, PROMPT, n)[eos_at]]
    cache = KVCache.for_model(model, capacity=len(PROMPT) + n - 1)
    generated = []
    for token in stream_generate(model, PROMPT, n, eos, cache=cache):
        generated.append(token)
        expected = len(PROMPT) + len(generated) - 1
        assert cache.seq_len == expected, (
            f"after token {len(generated)} the cache should hold prompt ({len(PROMPT)}) + generated "
            f"({len(generated)}) - 1 = {expected} positions (the newest token is not fed back until the next step), "
            f"it holds {cache.seq_len}"
        )
    assert_same_tokens(generated, hf_greedy(path, PROMPT, n, eos), "stream_generate")
    expected = len(PROMPT) + len(generated) - 1
    assert cache.seq_len == expected, (
        f"when generation ends the cache should hold {expected} positions (no decode pass for the last "
        f"token: its K/V would never be read), it holds {cache.seq_len}"
    )


def test_each_decode_pass_sends_only_the_newest_token(tiny_models_root):
    """The point of the cache: after the prefill, a pass computes one token against everything
    cached, never the sequence again (right tokens and a right seq_len do not show that)."""
    path = tiny_models_root / "llama"
    model = PassRecorder(engine_model(str(path)))
    n = 8
    cache = KVCache.for_model(model.model, capacity=len(PROMPT) + n - 1)
    generated = list(stream_generate(model, PROMPT, n, cache=cache))
    assert_same_tokens(generated, hf_greedy(path, PROMPT, n), "stream_generate")
    expected = [([len(PROMPT)], [0])] + [([1], [len(PROMPT) + i]) for i in range(n - 1)]
    for i, (got, want) in enumerate(zip(model.passes, expected)):
        what = "the prefill" if i == 0 else f"decode pass {i}"
        assert got == want, (
            f"{what} should send {want[0][0]} new token(s) after {want[1][0]} cached (extend_lens {want[0]}, "
            f"prefix_lens {want[1]}); it sent extend_lens {got[0]} after prefix_lens {got[1]}. A decode step runs only "
            "the newest token against the cache: recomputing the sequence gives the same tokens, at the naive cost"
        )
    assert len(model.passes) == len(expected), (
        f"{n} tokens take one prefill and {n - 1} decode passes ({len(expected)} forward passes), not "
        f"{len(model.passes)}"
    )


def test_cached_kv_equal_a_fresh_prefill_of_the_same_tokens(tiny_model_dir):
    """K_i and V_i never change once written: the K/V left by decoding step by step equal
    the K/V of one prefill over the same tokens."""
    model = engine_model(str(tiny_model_dir))
    stepped = KVCache.for_model(model, capacity=64)
    generated = list(stream_generate(model, PROMPT, 10, cache=stepped))
    fresh = KVCache.for_model(model, capacity=64)
    extend(model, [fresh], [PROMPT + generated[:-1]])
    n = fresh.seq_len
    assert stepped.seq_len == n, (
        f"the decoded cache holds {stepped.seq_len} positions, the prefill of the same tokens {n}"
    )
    close(stepped.k[:, :n], fresh.k[:, :n], f"{tiny_model_dir.name}: keys stored while decoding vs keys of one prefill")
    close(
        stepped.v[:, :n],
        fresh.v[:, :n],
        f"{tiny_model_dir.name}: values stored while decoding vs values of one prefill",
    )


@pytest.mark.parametrize("split", [1, 20, len(PROMPT) - 1], ids=lambda s: f"split at {s}")
def test_prefill_in_two_pieces_gives_the_same_logits_as_in_one(tiny_model_dir, split):
    model = engine_model(str(tiny_model_dir))
    whole = KVCache.for_model(model, capacity=len(PROMPT))
    expected = extend(model, [whole], [PROMPT])[0]
    pieces = KVCache.for_model(model, capacity=len(PROMPT))
    extend(model, [pieces], [PROMPT[:split]])
    assert pieces.seq_len == split, (
        f"after extending an empty cache by {split} tokens it should hold {split}, it holds {pieces.seq_len}"
    )
    got = extend(model, [pieces], [PROMPT[split:]])[0]
    assert pieces.seq_len == len(PROMPT), (
        f"after both pieces the cache should hold {len(PROMPT)} positions, it holds {pieces.seq_len}"
    )
    what = f"{tiny_model_dir.name}: prompt of {len(PROMPT)} tokens prefilled as {split} + {len(PROMPT) - split}"
    close(got, expected, f"{what}: logits differ from one prefill")
    close(got, hf_last_logits(tiny_model_dir, PROMPT), f"{what}: logits differ from transformers")
    close(pieces.k[:, : len(PROMPT)], whole.k[:, : len(PROMPT)], f"{what}: stored keys differ from one prefill")


def test_default_model_prefill_in_two_pieces(default_model_dir):
    model = engine_model(str(default_model_dir))
    prompt = list(range(1000, 1040))
    whole = KVCache.for_model(model, capacity=len(prompt))
    expected = extend(model, [whole], [prompt])[0]
    pieces = KVCache.for_model(model, capacity=len(prompt))
    extend(model, [pieces], [prompt[:17]])
    got = extend(model, [pieces], [prompt[17:]])[0]
    torch.testing.assert_close(
        got,
        expected,
        atol=1e-3,
        rtol=1e-4,
        msg=lambda m: f"SmolLM2, 40-token prompt prefilled as 17 + 23: logits differ from one prefill: {m}",
    )


def test_extend_runs_several_requests_in_one_ragged_pass(tiny_models_root):
    path = tiny_models_root / "qwen2"
    model = engine_model(str(path))
    prompts = [PROMPT, [72], list(b"Hello, world")]
    caches = [KVCache.for_model(model, capacity=4) for _ in prompts]
    logits = extend(model, caches, prompts)
    assert logits.shape[0] == len(prompts), (
        f"extend of {len(prompts)} requests should return one logits row each, got shape {tuple(logits.shape)}"
    )
    for i, prompt in enumerate(prompts):
        assert caches[i].seq_len == len(prompt), (
            f"request {i}: its cache should hold {len(prompt)} positions, it holds {caches[i].seq_len}"
        )
        close(logits[i], hf_last_logits(path, prompt), f"request {i} ({len(prompt)} tokens) of a batch of 3")


def test_reserve_doubles_and_keeps_what_is_stored():
    # float64, not the default float32: the grown cache must keep the model's dtype (and device)
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=3, dtype=torch.float64)
    stored = torch.arange(2 * 3 * 2, dtype=torch.float64).view(2, 3, 1, 2)
    cache.k[:, :3], cache.v[:, :3], cache.seq_len = stored, -stored, 3
    cache.reserve(3)
    assert cache.capacity == 3, (
        f"reserve(3) on a cache of capacity 3 should not grow it, capacity is now {cache.capacity}"
    )
    cache.reserve(4)
    assert cache.capacity == 6, (
        f"reserve(4) on a cache of capacity 3 should double it to 6, capacity is now {cache.capacity}"
    )
    cache.reserve(20)
    assert cache.capacity == 24, (
        f"reserve(20) on a cache of capacity 6 should double until it fits (12, 24), got {cache.capacity}"
    )
    assert tuple(cache.k.shape) == (2, 24, 1, 2) and tuple(cache.v.shape) == (2, 24, 1, 2), (
        f"k and v should both be [layers, capacity, kv_heads, head_dim] = [2, 24, 1, 2], got {list(cache.k.shape)} "
        f"and {list(cache.v.shape)}"
    )
    assert cache.seq_len == 3, f"growing must not change seq_len (3), got {cache.seq_len}"
    assert torch.equal(cache.k[:, :3], stored) and torch.equal(cache.v[:, :3], -stored), "growing lost the stored K/V"
    assert cache.k.dtype == cache.v.dtype == torch.float64, (
        f"a float64 cache grew into k {cache.k.dtype} and v {cache.v.dtype}: allocate the bigger tensors like the "
        "old ones (old.new_zeros(...)), or a bfloat16 model's K/V are silently cast to float32"
    )


def test_reserve_keeps_the_device():
    # The meta device (shapes, no data) stands in for a GPU: a cache grown with torch.zeros(...)
    # would land on the CPU, and the model's next K/V (on the GPU) could not be written into it.
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=2, device="meta")
    cache.reserve(5)
    devices = {cache.k.device.type, cache.v.device.type}
    assert devices == {"meta"} and cache.capacity == 8, (
        f"a cache on device 'meta' grew to capacity {cache.capacity} on {sorted(devices)}: allocate the bigger "
        "tensors like the old ones (old.new_zeros(...)), on the cache's own device"
    )


def test_generation_with_a_cache_that_must_grow(tiny_models_root):
    path = tiny_models_root / "llama3"
    model = engine_model(str(path))
    cache = KVCache.for_model(model, capacity=1)
    got = list(stream_generate(model, PROMPT, 20, cache=cache))
    assert_same_tokens(got, hf_greedy(path, PROMPT, 20), "starting from a cache of capacity 1")
    needed = len(PROMPT) + 20 - 1
    assert needed <= cache.capacity < 2 * needed, (
        f"{needed} positions were stored; growth by doubling from capacity 1 should end at a power of two "
        f"between {needed} and {2 * needed}, the capacity is {cache.capacity}"
    )
