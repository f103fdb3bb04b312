"""Stage 3 (graded): generation with a KV cache gives exactly stage 1's tokens and transformers'."""

from __future__ import annotations

import pytest

from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy
from s01_naive_generate.generate import naive_generate
from s03_kv_cache.generate import cached_generate

PROMPTS = {
    "one token": [72],
    "short": list(b"Hello, world"),
    "longer": list(b"The quick brown fox jumps over the lazy dog. " * 3),
}


@pytest.mark.parametrize("name", PROMPTS)
def test_cached_equals_naive_and_transformers_until_max_new_tokens(tiny_model_dir, name):
    prompt, n = PROMPTS[name], 16
    model = engine_model(str(tiny_model_dir))
    got = cached_generate(model, prompt, max_new_tokens=n)
    what = f"{tiny_model_dir.name}, prompt {name!r} ({len(prompt)} tokens)"
    assert_same_tokens(got, hf_greedy(tiny_model_dir, prompt, n), f"{what}, vs transformers")
    assert_same_tokens(got, naive_generate(model, prompt, n), f"{what}, vs stage 1's naive_generate")
    assert len(got) == n, f"{what}: with no EOS ids, generation must run to max_new_tokens={n}, got {len(got)} tokens"


def test_max_new_tokens_one_is_just_the_prefill(tiny_models_root):
    path = tiny_models_root / "qwen3"
    prompt = PROMPTS["short"]
    got = cached_generate(engine_model(str(path)), prompt, max_new_tokens=1)
    assert_same_tokens(got, hf_greedy(path, prompt, 1), "max_new_tokens=1")


def test_stops_at_eos_and_keeps_it(tiny_models_root):
    path = tiny_models_root / "llama"
    prompt = PROMPTS["short"]
    free_run = hf_greedy(path, prompt, 10)
    eos = free_run[3]  # pretend the 4th token transformers picks is an end-of-sequence id
    eos_ids = [next(i for i in range(1000) if i not in free_run), eos]  # several EOS ids: any of them ends it
    got = cached_generate(engine_model(str(path)), prompt, max_new_tokens=10, eos_token_ids=eos_ids)
    assert_same_tokens(got, hf_greedy(path, prompt, 10, eos=[eos]), f"with EOS ids {eos_ids} (any of them ends it)")
    assert got[-1] == eos, "the EOS token ends the output and is kept in it"


def test_default_model_chat_equals_naive_and_transformers(default_model_dir):
    tok = engine_tokenizer(str(default_model_dir))
    model = engine_model(str(default_model_dir))
    prompt = tok.encode_prompt("What is the capital of France?")
    got = cached_generate(model, prompt, 16, tok.eos_token_ids)
    assert_same_tokens(
        got, hf_greedy(default_model_dir, prompt, 16, tok.eos_token_ids), "SmolLM2 chat prompt, vs transformers", tok
    )
    assert_same_tokens(
        got, naive_generate(model, prompt, 16, tok.eos_token_ids), "SmolLM2 chat prompt, vs stage 1", tok
    )
    assert "Paris" in tok.decode(got)
