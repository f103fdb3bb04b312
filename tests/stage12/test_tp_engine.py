"""Stage 12 (graded): a 2-rank tensor-parallel engine gives the tokens of one device.

One group per model family (Qwen2, Qwen3, and Llama with 8:1 GQA and biases everywhere, whose
single KV head is replicated on both ranks), started once per family and stopped by the
fixture whatever the tests do. Each group runs greedy and seeded sampling with chunked prefill
and the radix cache on, and is checked against stage 10's engine on one device, and its
collectives are counted: two all-reduces per layer, one for the embedding, one gather per step.
Stage 11's grammars still hold: rank 0 masks the gathered logits."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from penalty_cases import assert_penalties_like_stage3, penalised_params
from reference import assert_logprobs_match
from tp_helpers import KNOBS, PROMPTS, greedy, pid_running, reference_outputs, sampled

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "stage11"))

import prompt_logprob_cases as scored
from s00_foundation import cpu_ops
from s02_request_and_sampling.sampler import sample_with_penalties
from s10_overlap_scheduling import overlap_worker
from s12_tensor_parallel.engine import TPEngine
from structured_helpers import SCHEMAS, assert_follows, constrained  # noqa: E402
from structured_helpers import engine_on as structured_engine_on  # noqa: E402

# Llama with tied embeddings (the "llama" tiny model) runs at tp=2 in test_tp_serving.py.
FAMILIES_UNDER_TP = ("qwen2", "qwen3", "llama_gqa_bias")


@pytest.fixture(scope="module", params=FAMILIES_UNDER_TP)
def tp2(request, tiny_models_root):
    path = tiny_models_root / request.param
    engine = TPEngine(str(path), tp_size=2, tp_timeout_s=30, **KNOBS)
    try:
        yield path, engine
    finally:
        pids = engine.launcher.pids
        engine.shutdown()
        left = [pid for pid in pids if pid_running(pid)]
        assert not left, f"{path.name}: shutdown left rank processes running: {left}"


def test_greedy_tokens_equal_one_device(tp2):
    path, engine = tp2
    assert engine.scheduler.enable_overlap, (
        "the TP engine should run stage 10's overlapped loop when asked (disable_overlap=False)"
    )
    expected = reference_outputs(path, greedy(10))
    cached_before = engine.scheduler.stats.cached_tokens
    got = [out.output_ids for out in engine.generate(PROMPTS, greedy(10))]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, (
            f"{path.name}, tp=2, prompt {i} ({len(PROMPTS[i])} tokens): greedy tokens {g}, one device's {e}; "
            "check each rank's heads (head_ranges), the row-parallel all-reduce, the vocabulary-parallel embedding, "
            "the logits' gather, and the batch a follower rebuilds (BatchMessage.to_forward_batch: each request's "
            "table row whole; a prompt reusing a cached prefix reads slots written in an earlier step)"
        )
    assert engine.scheduler.stats.cached_tokens > cached_before, (
        f"{path.name}: the prompts sharing a 24-token prefix found nothing in the radix cache under TP"
    )


def test_seeded_sampling_equals_one_device(tp2):
    path, engine = tp2
    params = [sampled(8, seed=100 + i) for i in range(len(PROMPTS))]
    expected = reference_outputs(path, params)
    got = [out.output_ids for out in engine.generate(PROMPTS, params)]
    assert got == expected, f"{path.name}, tp=2: seeded sampling gave {got}, one device {expected}"


def test_collectives_per_step_are_what_the_lesson_says(tp2):
    path, engine = tp2
    layers = engine.model.config.num_hidden_layers
    before, steps_before = dict(engine.tp.counts), engine.scheduler.stats.steps
    engine.generate(PROMPTS[:2], greedy(4))
    steps = engine.scheduler.stats.steps - steps_before
    delta = {name: engine.tp.counts[name] - before.get(name, 0) for name in ("all_reduce", "gather", "broadcast")}
    assert steps > 0
    assert delta == {"all_reduce": steps * (2 * layers + 1), "gather": steps, "broadcast": steps}, (
        f"{path.name}: {steps} steps of a {layers}-layer model made {delta}; expected per step "
        f"2 all-reduces per layer (after o_proj and down_proj) + 1 (the embedding), 1 gather (the logits), "
        "1 broadcast (the batch)"
    )


def test_each_rank_holds_its_share_of_the_kv_cache(tp2):
    path, engine = tp2
    full = engine.model.full_config
    pool = engine.runner.token_to_kv_pool
    expected = max(1, full.num_key_value_heads // 2)
    assert pool.k_buffer[0].shape[1] == expected, (
        f"{path.name}: {full.num_key_value_heads} KV heads on 2 ranks: rank 0's pool should hold {expected} "
        f"head(s), holds {pool.k_buffer[0].shape[1]}"
    )
    qkv = engine.model.model.layers[0].self_attn.qkv_proj.weight
    d = full.head_dim
    assert qkv.shape[0] == (full.num_attention_heads // 2 + 2 * expected) * d, (
        f"{path.name}: rank 0's qkv_proj has {qkv.shape[0]} rows, expected its half of the query heads and "
        f"{expected} KV head(s) for k and v, of {d} rows each"
    )


def test_rank_0_samples_from_the_whole_vocabulary_and_nothing_more(tp2, monkeypatch):
    path, engine = tp2
    seen = []

    def recording_sample(logits, reqs):
        seen.append(tuple(logits.shape))
        return sample_with_penalties(logits, reqs)

    monkeypatch.setattr(overlap_worker, "sample_with_penalties", recording_sample)
    engine.generate(PROMPTS[:2], sampled(2, seed=7))
    vocab = engine.model.full_config.vocab_size
    assert seen and all(shape[-1] == vocab for shape in seen), (
        f"{path.name}: rank 0 sampled from logits of shapes {seen}; the gathered logits must cover exactly the "
        f"vocabulary ({vocab}): every rank's slice, in rank order, without the padding rows past the vocabulary"
    )


def test_logprobs_under_tp_are_the_whole_vocabularys(tp2):
    """Rank 0 takes the log-probabilities from the gathered logits: a log_softmax over every rank's
    slice of the vocabulary, equal to transformers' on one device."""
    path, engine = tp2
    params = [replace(sampled(6, seed=40 + i), logprobs=2) for i in range(2)]
    for i, out in enumerate(engine.generate(PROMPTS[:2], params)):
        assert_logprobs_match(path, PROMPTS[i], out, 2, f"{path.name}, tp=2, request {i}")


def test_penalties_under_tp(tp2):
    """Rank 0 samples, so rank 0 keeps the penalty counts, over the gathered (whole) vocabulary:
    the tokens of stage 3's engine on one device."""
    path, engine = tp2
    prompts, params = [*PROMPTS[:3], [7, 8, 9], [50] * 6, [33, 34]], penalised_params()
    assert_penalties_like_stage3(path, prompts, params, engine.generate(prompts, params), f"{path.name}, tp=2")


def test_a_grammar_is_followed_under_tp(tp2):
    """Stage 11 under TP: rank 0 masks the gathered logits, so a JSON schema is followed and the
    tokens are those of stage 11's engine on one device."""
    path, engine = tp2
    prompts = [[72, 101, 108, 108, 111], [40 + i % 60 for i in range(12)]]
    schemas = [SCHEMAS["flat"], SCHEMAS["nested"]]
    params = [constrained("json", schemas[0]), constrained("json", schemas[1], temperature=1.0, seed=3)]
    expected = structured_engine_on(path, **KNOBS).generate(prompts, params)
    got = engine.generate(prompts, params)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_follows(g.text, g.finish_reason, "json", schemas[i], f"{path.name}, tp=2, request {i}")
        assert g.output_ids == e.output_ids, (
            f"{path.name}, tp=2, request {i}: constrained tokens {g.output_ids}, one device's {e.output_ids}"
        )


def test_a_rank_loads_the_cpu_kernels_before_its_first_forward(tiny_models_root, monkeypatch):
    """One process loads the fused CPU loops in its first forward. A rank loads them while its
    runner is built, before the ranks' ready barrier: loading takes the kernel cache's lock, and a
    rank waiting for it inside a forward keeps the others waiting in a collective, against the
    group's timeout (a test run beside a busy build timed out that way)."""
    loads = []
    real = cpu_ops.load
    monkeypatch.setattr(cpu_ops, "load", lambda: loads.append("load") or real())
    engine = TPEngine(str(tiny_models_root / "qwen2"), tp_size=1, **KNOBS)
    try:
        assert loads, "building a rank's runner did not load the CPU kernels (cpu_ops.load): make_tp_runner must"
    finally:
        engine.shutdown()


def test_prompt_logprobs_under_tp(tp2):
    """The prompt rows are part of the step's message: every rank projects them (the logits'
    gather takes every rank), rank 0 scores them over the whole vocabulary, equal to transformers'."""
    path, engine = tp2
    for run in ("first run", "again, prompts cached"):
        outputs = engine.generate(scored.PROMPTS, scored.prompt_logprob_params())
        scored.assert_prompt_logprobs_case(path, outputs, f"{path.name}, tp=2, {run}")
