"""Stage 7 (graded): chunking changes how a prompt is computed, never which tokens come out.

For chunk budgets from 1 token upwards, with and without the radix cache, with pages of 1, 4 and
16 slots, prompts longer than the budget by one token and by many chunks give every request the
tokens transformers gives it; the forward passes never compute more prompt tokens than the
budget; seeded sampling gives the tokens the request gets alone (stage 3), whatever the budget."""

from __future__ import annotations

import pytest

import prompt_logprob_cases as scored
from chunked_helpers import assert_pool_free_after_tree, chunked_engine, greedy, random_prompt, run_checked
from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy
from s02_request_and_sampling.sampling_params import SamplingParams
from s03_kv_cache.engine import generate as stage3_generate


def workload(budget: int):
    """Prompts shorter than, equal to, one longer than, and many chunks longer than the budget."""
    lengths = [max(1, budget - 1), budget, budget + 1, 5 * budget + 3, 2]
    prompts = [random_prompt(n, seed=100 * budget + i) for i, n in enumerate(lengths)]
    return prompts, [5, 4, 6, 5, 3]


def assert_within_budget(recorder, budget: int, what: str) -> None:
    """No forward pass computed more prompt tokens than the budget (a budget of 1 aside: there a
    chunk of one token looks like a decode in the pass's extend_lens)."""
    for number, (extend_lens, _) in enumerate(recorder.passes, 1):
        prefill = sum(e for e in extend_lens if e > 1) if budget > 1 else None
        assert prefill is None or prefill <= budget, (
            f"{what}: forward pass {number} computed {prefill} prompt tokens ({extend_lens}), more than the budget "
            f"of {budget} (a chunk is cut to the budget in tokens, not rounded to whole pages: prefill_len)"
        )


@pytest.mark.parametrize("budget", [1, 2, 7, 16])
def test_greedy_tokens_identical_to_transformers_in_any_budget(tiny_model_dir, budget):
    prompts, limits = workload(budget)
    what = f"{tiny_model_dir.name}, chunked_prefill_size={budget}"
    engine, recorder = chunked_engine(tiny_model_dir, budget, pool_size=1024)
    reqs = run_checked(engine, prompts, [greedy(n) for n in limits], what)
    for i, (req, prompt, n) in enumerate(zip(reqs, prompts, limits)):
        expected = hf_greedy(tiny_model_dir, prompt, n)
        assert_same_tokens(
            req.output_ids, expected, f"{what}: request {i} ({len(prompt)}-token prompt) vs transformers"
        )
    assert_within_budget(recorder, budget, what)
    longest = max(len(p) for p in prompts)
    assert len(recorder.passes) >= -(-longest // budget), (
        f"{what}: a {longest}-token prompt needs at least {-(-longest // budget)} passes with a budget of {budget}, "
        f"but only {len(recorder.passes)} ran: was it computed whole?"
    )
    assert_pool_free_after_tree(engine, what)


@pytest.mark.parametrize("enable_radix_cache", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_every_budget_and_page_size_gives_the_tokens_of_transformers(tiny_models_root, enable_radix_cache, page_size):
    path = tiny_models_root / "qwen2"
    shared = random_prompt(23, seed=7)
    prompts = [shared + random_prompt(n, seed=n) for n in (2, 17, 31, 1)] + [random_prompt(41, seed=3), shared[:9]]
    limits = [6, 3, 5, 4, 6, 5]
    expected = [hf_greedy(path, prompt, n) for prompt, n in zip(prompts, limits)]
    for budget in (1, 3, 8, 40, 64):
        what = (
            f"qwen2, chunked_prefill_size={budget}, page_size={page_size}, radix cache "
            f"{'on' if enable_radix_cache else 'off'}"
        )
        engine, recorder = chunked_engine(
            path,
            budget,
            page_size=page_size,
            enable_radix_cache=enable_radix_cache,
            pool_size=1024,
            max_running_requests=4,
        )
        reqs = run_checked(engine, prompts, [greedy(n) for n in limits], what)
        for i, (req, ref) in enumerate(zip(reqs, expected)):
            assert_same_tokens(
                req.output_ids, ref, f"{what}: request {i} ({len(prompts[i])}-token prompt) vs transformers"
            )
        assert_within_budget(recorder, budget, what)
        assert_pool_free_after_tree(engine, what)


def test_seeded_sampling_is_independent_of_the_budget(tiny_models_root):
    """A chunk must not be sampled: sampling would draw from the request's own generator, and
    its tokens would then depend on how its prompt was cut."""
    path = tiny_models_root / "llama3"
    prompts = [random_prompt(n, seed=n) for n in (37, 5, 60, 12)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=10 + i, max_new_tokens=8, ignore_eos=True) for i in range(4)
    ]
    model, tokenizer = engine_model(str(path)), engine_tokenizer(str(path))
    expected = stage3_generate(model, tokenizer, prompts, params)  # each request alone, unchunked
    for budget in (1, 6, 25):
        what = f"llama3, seeded sampling, chunked_prefill_size={budget}"
        engine, _ = chunked_engine(path, budget, pool_size=1024)
        reqs = run_checked(engine, prompts, params, what)
        for i, (req, ref) in enumerate(zip(reqs, expected)):
            assert_same_tokens(
                req.output_ids,
                ref.output_ids,
                f"{what}: request {i} (seed {params[i].seed}) vs alone, unchunked (stage 3)",
            )


@pytest.mark.parametrize("chunk", [1, 7])
def test_prompt_logprobs_across_chunks(tiny_models_root, chunk):
    """A prompt cut in chunks is scored chunk by chunk, each position once and in order (the last
    position of a chunk scores the first token of the next); chunks of one token make passes in
    which every request sends one token, yet score prompt positions. Twice: the second run finds
    the prompts in the tree."""
    path = tiny_models_root / "qwen2"
    engine, _ = chunked_engine(path, chunk, pool_size=1024)
    for run in ("first run", "again, prompts cached"):
        outputs = engine.generate(scored.PROMPTS, scored.prompt_logprob_params())
        scored.assert_prompt_logprobs_case(path, outputs, f"chunked_prefill_size={chunk}, {run}")
    assert_pool_free_after_tree(engine, f"chunked_prefill_size={chunk}, after prompt_logprobs")
