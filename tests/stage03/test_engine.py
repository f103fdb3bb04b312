"""Stage 3 (graded): requests with sampling on top of the cache - Req's lengths kept right,
the same outputs as stage 2's engine."""

from __future__ import annotations

from recording import PassRecorder
from reference import (
    assert_logprobs_match,
    assert_same_tokens,
    engine_model,
    engine_tokenizer,
    hf_greedy,
    hf_penalized_greedy,
)
from s02_request_and_sampling.engine import generate as stage2_generate
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s03_kv_cache.engine import forward_step, generate
from s03_kv_cache.kv_cache import KVCache

PROMPTS = [list(b"Hello, world"), [72], list(b"The quick brown fox jumps over the lazy dog.")]


def test_forward_step_keeps_req_lengths_and_cache_in_step(tiny_models_root):
    path = tiny_models_root / "qwen3"
    model = engine_model(str(path))
    reqs = [
        Req(
            rid=i, origin_input_ids=p, sampling_params=SamplingParams(temperature=0, max_new_tokens=6), eos_token_ids=[]
        )
        for i, p in enumerate(PROMPTS)
    ]
    caches = [KVCache.for_model(model, capacity=4) for _ in reqs]
    recorder = PassRecorder(model)
    for step in range(6):
        cached_before = [req.cached_len for req in reqs]
        forward_step(recorder, reqs, caches)
        sent = [len(p) for p in PROMPTS] if step == 0 else [1] * len(reqs)
        assert recorder.passes[step:] == [(sent, cached_before)], (
            f"step {step} should be one forward pass sending {sent} new tokens after {cached_before} cached "
            f"(extend_lens, prefix_lens); it ran {recorder.passes[step:]}. Each request sends only what its cache "
            "lacks (fill_ids[cached_len:device_len]): recomputing the sequence gives the same tokens, at the naive cost"
        )
        for req, cache in zip(reqs, caches):
            where = f"request {req.rid} (prompt of {len(req.origin_input_ids)} tokens) after step {step}"
            assert len(req.output_ids) == step + 1, (
                f"{where}: should have {step + 1} output tokens, has {len(req.output_ids)}"
            )
            assert req.cached_len == len(req.fill_ids) - 1, (
                f"{where}: cached_len should be {len(req.fill_ids) - 1} (every token but the newest), got "
                f"{req.cached_len}"
            )
            assert req.device_len == len(req.fill_ids), (
                f"{where}: device_len should be {len(req.fill_ids)}, got {req.device_len}"
            )
            assert cache.seq_len == req.cached_len, (
                f"{where}: the cache holds {cache.seq_len} positions but cached_len is {req.cached_len}"
            )
    for req in reqs:
        assert req.finished and req.finished_reason.type == "length", (
            f"request {req.rid} should end with 'length', got {req.finished_reason}"
        )
        assert_same_tokens(req.output_ids, hf_greedy(path, req.origin_input_ids, 6), f"request {req.rid}")


def test_greedy_generate_matches_transformers(tiny_models_root):
    path = tiny_models_root / "llama"
    tok = engine_tokenizer(str(path))
    outputs = generate(
        engine_model(str(path)), tok, PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    )
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs)):
        assert_same_tokens(out.output_ids, hf_greedy(path, prompt, 10), f"request {i}", tok)
        assert out.finish_reason.type == "length" and out.prompt_tokens == len(prompt), f"request {i}: {out}"


def test_seeded_sampling_equals_stage2(tiny_models_root):
    """The cache changes the cost, not the result: with the same seeds, stage 2's engine
    (recomputing everything) and yours sample the same tokens."""
    path = tiny_models_root / "llama3"
    tok, model = engine_tokenizer(str(path)), engine_model(str(path))
    params = [
        SamplingParams(temperature=0.8, top_k=20, max_new_tokens=12, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=7, seed=2),
        SamplingParams(temperature=0, max_new_tokens=9),
    ]
    expected = stage2_generate(model, tok, PROMPTS, params)
    got = generate(model, tok, PROMPTS, params)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_same_tokens(g.output_ids, e.output_ids, f"request {i} ({params[i]}), vs stage 2", tok)
        assert g.finish_reason == e.finish_reason, (
            f"request {i}: finish reason {g.finish_reason}, stage 2 says {e.finish_reason}"
        )
        assert g.text == e.text, f"request {i}: text {g.text!r}, stage 2 says {e.text!r}"


def test_logprobs_come_with_the_cached_steps(tiny_models_root):
    """A request with logprobs=2 gets one entry per token from the cached engine too, equal to
    transformers' (the logits of a cached step are the same distribution as a full recompute)."""
    path = tiny_models_root / "qwen3"
    model, tokenizer = engine_model(str(path)), engine_tokenizer(str(path))
    params = [
        SamplingParams(temperature=0.9, max_new_tokens=7, ignore_eos=True, seed=2, logprobs=2),
        SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True),
    ]
    asked, not_asked = generate(model, tokenizer, PROMPTS[:2], params)
    assert not_asked.logprobs is None, f"a request without logprobs gets logprobs=None, got {not_asked.logprobs!r}"
    assert_logprobs_match(path, PROMPTS[0], asked, 2, "stage 3's engine, a sampled request with logprobs=2")


def test_penalties_see_every_token_of_the_cached_steps(tiny_models_root):
    """Penalties count the tokens the sampler drew: the cached engine must sample through
    append_sampled (stage 2) to keep them. Greedy with penalties equals transformers'; sampled
    with penalties equals stage 2's."""
    path = tiny_models_root / "qwen3"
    model, tokenizer = engine_model(str(path)), engine_tokenizer(str(path))
    penalised = SamplingParams(
        temperature=0, max_new_tokens=20, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5
    )
    params = [
        penalised,
        SamplingParams(temperature=0.9, max_new_tokens=14, ignore_eos=True, seed=4, repetition_penalty=1.4),
        SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True),
    ]
    got = generate(model, tokenizer, PROMPTS, params)
    expected = hf_penalized_greedy(path, PROMPTS[0], 20, penalised)
    assert expected != hf_greedy(path, PROMPTS[0], 20), "the test's penalties should change this greedy output"
    assert_same_tokens(got[0].output_ids, expected, "stage 3, greedy with frequency and presence penalties", tokenizer)
    sampled = stage2_generate(model, tokenizer, PROMPTS, params)[1]
    assert_same_tokens(
        got[1].output_ids, sampled.output_ids, "stage 3, sampled with repetition_penalty=1.4, vs stage 2"
    )
