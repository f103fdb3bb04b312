"""Stage 4 (graded): a static batch of requests of different lengths runs out of one pool,
token for token like stage 3 and transformers, and gives every slot back."""

from __future__ import annotations

import pytest
import torch

import prompt_logprob_cases as scored
from penalty_cases import assert_penalties_like_stage3, penalised_params
from recording import PassRecorder
from reference import assert_logprobs_match, assert_same_tokens, engine_model, engine_tokenizer, hf_greedy
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s03_kv_cache.engine import generate as stage3_generate
from s03_kv_cache.generate import cached_generate
from s04_paged_kv_pool.engine import StaticBatchEngine, generate_static_batch
from s04_paged_kv_pool.memory_pool import PoolExhaustedError

PROMPTS = [list(b"Hello, world"), [72], list(b"The quick brown fox jumps over the lazy dog. " * 2), list(b"abc")]


def greedy_reqs(prompts, max_new_tokens, eos=()):
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    return [
        Req(
            rid=i,
            origin_input_ids=p,
            sampling_params=SamplingParams(temperature=0, max_new_tokens=n),
            eos_token_ids=eos,
        )
        for i, (p, n) in enumerate(zip(prompts, limits))
    ]


@pytest.mark.parametrize("prompt", [[72], PROMPTS[2]], ids=["one token", "longer"])
def test_single_request_equals_stage3_and_transformers(tiny_model_dir, prompt):
    model = engine_model(str(tiny_model_dir))
    [got] = generate_static_batch(model, [prompt], 12)
    what = f"{tiny_model_dir.name}, one request of {len(prompt)} tokens"
    assert_same_tokens(got, hf_greedy(tiny_model_dir, prompt, 12), f"{what}, vs transformers")
    assert_same_tokens(got, cached_generate(model, prompt, 12), f"{what}, vs stage 3")


def test_static_batch_of_mixed_prompt_lengths(tiny_model_dir):
    got = generate_static_batch(engine_model(str(tiny_model_dir)), PROMPTS, 12)
    for i, prompt in enumerate(PROMPTS):
        assert_same_tokens(
            got[i],
            hf_greedy(tiny_model_dir, prompt, 12),
            f"{tiny_model_dir.name}, request {i} ({len(prompt)}-token prompt) of a batch of {len(PROMPTS)}",
        )
        assert len(got[i]) == 12, (
            f"request {i}: with no EOS ids it must run to max_new_tokens=12, got {len(got[i])} tokens"
        )


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_sizes_give_identical_tokens(tiny_models_root, page_size):
    for family in ("llama3", "qwen3"):
        path = tiny_models_root / family
        model = engine_model(str(path))
        got = generate_static_batch(model, PROMPTS, 10, page_size=page_size)
        for i, prompt in enumerate(PROMPTS):
            assert_same_tokens(got[i], hf_greedy(path, prompt, 10), f"{family}, page size {page_size}, request {i}")


def test_prefill_is_one_ragged_pass_then_one_decode_pass_per_step(tiny_models_root):
    spy = PassRecorder(engine_model(str(tiny_models_root / "llama")))
    limits = [6, 3, 5, 1]
    generate_static_batch(spy, PROMPTS, limits)
    lens = [len(p) for p in PROMPTS]
    assert spy.passes, "the engine never ran the model"
    extend_lens, prefix_lens = spy.passes[0]
    assert extend_lens == lens and prefix_lens == [0] * 4, (
        f"the first pass should prefill all 4 prompts at once (extend_lens {lens}, nothing cached), "
        f"it had extend_lens={extend_lens}, prefix_lens={prefix_lens}"
    )
    # After step s, the requests still running are those with max_new_tokens > s + 1.
    expected = [[1] * sum(n > s for n in limits) for s in range(1, max(limits))]
    got = [e for e, _ in spy.passes[1:]]
    assert got == expected, (
        f"after the prefill each step should be ONE decode pass over the running requests (max_new_tokens {limits}: "
        f"batch sizes {[len(e) for e in expected]}), your engine ran passes with extend_lens {got}"
    )


def test_requests_finish_at_different_steps_and_free_their_slots(tiny_models_root):
    path = tiny_models_root / "qwen2"
    model = engine_model(str(path))
    eos = hf_greedy(path, PROMPTS[0], 10)[4]  # request 0 stops early on this "EOS"
    reqs = greedy_reqs(PROMPTS, [10, 3, 10, 7], eos=[eos])
    engine = StaticBatchEngine(model, pool_size=4 * 64, page_size=4, max_running_requests=4)
    engine.add_requests(reqs)
    table = engine.runner.req_to_token_pool.req_to_token
    step = 0
    with torch.inference_mode():
        while engine.running:
            finished = engine.step()
            step += 1
            for r in finished:
                assert r not in engine.running, f"step {step}: request {r.rid} finished but is still running"
                assert r.req_pool_idx is None, (
                    f"step {step}: request {r.rid} finished and gave its table row back, yet still names row "
                    f"{r.req_pool_idx} (req_pool_idx): the next request to take that row would share it"
                )
            held = [table[r.req_pool_idx, : r.cached_len] for r in engine.running]
            engine.runner.allocator.check_invariants(held)  # finished requests own nothing any more
            pages = sum(-(-r.cached_len // 4) for r in engine.running)
            assert engine.runner.allocator.available_size() == (64 - pages) * 4, (
                f"step {step}: the running requests hold {pages} pages of 4, so {(64 - pages) * 4} slots should be "
                "free, "
                f"{engine.runner.allocator.available_size()} are (finished requests must free their slots at once)"
            )
    for r in reqs:
        assert_same_tokens(
            r.output_ids,
            hf_greedy(path, r.origin_input_ids, r.sampling_params.max_new_tokens, [eos]),
            f"request {r.rid}",
        )
    assert engine.runner.allocator.available_size() == 4 * 64, "after the batch every slot should be free"
    assert engine.runner.req_to_token_pool.available_size() == 4, "after the batch every request row should be free"


@pytest.mark.parametrize("page_size", [1, 4])
def test_pool_too_small_fails_before_any_model_work(tiny_models_root, page_size):
    path = tiny_models_root / "llama"
    prompts, n = PROMPTS[:3], 8
    need = sum(-(-(len(p) + n - 1) // page_size) for p in prompts) * page_size
    exact = PassRecorder(engine_model(str(path)))
    got = generate_static_batch(exact, prompts, n, pool_size=need, page_size=page_size)
    for i, p in enumerate(prompts):
        assert_same_tokens(
            got[i], hf_greedy(path, p, n), f"pool of exactly {need} slots (page size {page_size}), request {i}"
        )
    spy = PassRecorder(engine_model(str(path)))
    engine = StaticBatchEngine(spy, pool_size=need - page_size, page_size=page_size, max_running_requests=4)
    with pytest.raises(PoolExhaustedError) as error:
        engine.run(greedy_reqs(prompts, n))
    message = str(error.value)
    assert str(need) in message and str(need - page_size) in message, (
        f"the error should say how many slots the batch needs ({need}) and how many the pool has "
        f"({need - page_size}); got: {message}"
    )
    assert spy.passes == [], f"the engine ran {len(spy.passes)} forward passes before refusing; it must check first"
    assert engine.runner.allocator.available_size() == need - page_size, "a refused batch must not hold any slot"


def test_seeded_sampling_per_request_equals_stage3(tiny_models_root):
    path = tiny_models_root / "llama3"
    tok, model = engine_tokenizer(str(path)), engine_model(str(path))
    prompts = ["Hi", "Tell me a story", "x"]
    params = [
        SamplingParams(temperature=0.7, top_k=30, max_new_tokens=9, seed=11),
        SamplingParams(temperature=0, max_new_tokens=5),
        SamplingParams(temperature=1.2, min_p=0.05, max_new_tokens=12, seed=12),
    ]
    engine = StaticBatchEngine(model, pool_size=256, page_size=4, max_running_requests=3)
    got = engine.generate(tok, prompts, params)
    expected = stage3_generate(model, tok, prompts, params)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_same_tokens(g.output_ids, e.output_ids, f"request {i} ({params[i]}), vs stage 3", tok)
        assert g.finish_reason == e.finish_reason, (
            f"request {i}: finish reason {g.finish_reason}, stage 3 says {e.finish_reason}"
        )


def test_logprobs_in_a_static_batch(tiny_models_root):
    """Each request of a static batch that asked gets its own tokens' logprobs (its own row of the
    batch's logits), equal to transformers'; the one that did not ask gets None."""
    path = tiny_models_root / "llama3"
    tok, model = engine_tokenizer(str(path)), engine_model(str(path))
    prompts = ["Hi", "Tell me a story", "x"]
    params = [
        SamplingParams(temperature=0.7, max_new_tokens=6, seed=11, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=4),
    ]
    engine = StaticBatchEngine(model, pool_size=256, page_size=4, max_running_requests=3)
    got = engine.generate(tok, prompts, params)
    assert got[1].logprobs is None, f"a request without logprobs gets logprobs=None, got {got[1].logprobs!r}"
    for i in (0, 2):
        assert_logprobs_match(
            path, tok.encode_prompt(prompts[i]), got[i], params[i].logprobs, f"request {i} of a static batch of 3"
        )


def test_default_model_static_batch_equals_transformers(default_model_dir):
    tok = engine_tokenizer(str(default_model_dir))
    # Different prompt lengths; "Hi!" ends early on EOS while the other request goes on.
    prompts = [tok.encode_prompt(q) for q in ("What is the capital of France?", "Hi!")]
    got = generate_static_batch(engine_model(str(default_model_dir)), prompts, 16, tok.eos_token_ids, page_size=4)
    for i, prompt in enumerate(prompts):
        assert_same_tokens(
            got[i],
            hf_greedy(default_model_dir, prompt, 16, tok.eos_token_ids),
            f"SmolLM2, request {i} of a static batch of {len(prompts)}",
            tok,
        )


def test_penalties_in_a_static_batch(tiny_models_root):
    """Each request's penalties follow its own row of the batch (through stage 2's append_sampled)."""
    path = tiny_models_root / "qwen3"
    prompts, params = [*PROMPTS, list(b"xyz"), list(b"min")], penalised_params()
    engine = StaticBatchEngine(engine_model(str(path)), pool_size=512, page_size=4, max_running_requests=6)
    got = engine.generate(engine_tokenizer(str(path)), prompts, params)
    assert_penalties_like_stage3(path, prompts, params, got, "a static batch of 6")


def test_prompt_logprobs_in_a_static_batch(tiny_models_root):
    """The prefill pass returns the asking requests' prompt rows after every request's last row:
    each asking request gets one entry per prompt token, equal to transformers', the others None,
    and the sampler still reads each request's own last row."""
    path = tiny_models_root / "qwen3"
    engine = StaticBatchEngine(engine_model(str(path)), pool_size=1024, page_size=4, max_running_requests=6)
    outputs = engine.generate(engine_tokenizer(str(path)), scored.PROMPTS, scored.prompt_logprob_params())
    scored.assert_prompt_logprobs_case(path, outputs, "stage 4's static batch")
