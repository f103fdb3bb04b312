"""Stage 1 (graded): naive greedy generation equals transformers, token for token."""

from __future__ import annotations

import pytest
import torch

from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy, hf_last_logits
from s01_naive_generate.generate import naive_generate, next_token_logits

PROMPTS = {
    "one token": [72],
    "short": list(b"Hello, world"),
    "longer": list(b"The quick brown fox jumps over the lazy dog. " * 3),
}


def test_next_token_logits_match_transformers(tiny_model_dir):
    prompt = PROMPTS["short"]
    got = next_token_logits(engine_model(str(tiny_model_dir)), prompt)
    expected = hf_last_logits(tiny_model_dir, prompt)
    assert got.shape == expected.shape, (
        f"logits should have shape {tuple(expected.shape)} (one row over the vocabulary), got {tuple(got.shape)}"
    )
    torch.testing.assert_close(
        got, expected, atol=2e-4, rtol=1e-4, msg=lambda m: f"logits for the next token differ from transformers: {m}"
    )


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_matches_transformers_until_max_new_tokens(tiny_model_dir, name):
    prompt, n = PROMPTS[name], 12
    got = naive_generate(engine_model(str(tiny_model_dir)), prompt, max_new_tokens=n)
    assert not (len(got) > n and list(got[: len(prompt)]) == list(prompt)), (
        f"naive_generate returned {len(got)} tokens starting with the {len(prompt)}-token prompt: it returns only the "
        f"new tokens (here {n}), as transformers' output is read after the prompt"
    )
    assert_same_tokens(got, hf_greedy(tiny_model_dir, prompt, n), f"{tiny_model_dir.name}, prompt {name!r}")
    assert len(got) == n, f"with no EOS ids, generation must run to max_new_tokens={n}, got {len(got)} tokens"


def test_stops_at_eos_and_keeps_it(tiny_models_root):
    path = tiny_models_root / "llama"
    prompt = PROMPTS["short"]
    free_run = hf_greedy(path, prompt, 10)
    eos = free_run[3]  # pretend the 4th token transformers picks is an end-of-sequence id
    # A model may have several EOS ids (Llama 3, Qwen): any of them ends the output. This one's
    # other is an id the run never picks.
    eos_ids = [next(i for i in range(1000) if i not in free_run), eos]
    expected = hf_greedy(path, prompt, 10, eos=[eos])
    got = naive_generate(engine_model(str(path)), prompt, max_new_tokens=10, eos_token_ids=eos_ids)
    assert_same_tokens(got, expected, f"with EOS ids {eos_ids} (any of them ends the output)")
    assert got[-1] == eos, "the EOS token ends the output and is kept in it"


def test_default_model_chat_matches_transformers(default_model_dir):
    tok = engine_tokenizer(str(default_model_dir))
    prompt = tok.encode_prompt("What is the capital of France?")
    got = naive_generate(engine_model(str(default_model_dir)), prompt, 20, tok.eos_token_ids)
    expected = hf_greedy(default_model_dir, prompt, 20, tok.eos_token_ids)
    assert_same_tokens(got, expected, "SmolLM2 chat prompt", tok)
    assert "Paris" in tok.decode(got)
