"""Stage 7 (graded): a prompt's chunks ride in the same forward pass as the running requests'
decodes, the half-prefilled request keeps its place, and nobody is sampled mid-prefill."""

from __future__ import annotations

import torch

from chunked_helpers import chunked_engine, greedy, random_prompt, run_checked, sampling_spy
from invariants import capped_steps
from reference import assert_same_tokens, hf_greedy


def test_chunks_run_beside_decodes_with_the_same_tokens(tiny_models_root):
    path = tiny_models_root / "llama"
    engine, recorder = chunked_engine(path, 16, pool_size=1024)
    short = [random_prompt(n, seed=n) for n in (4, 6, 3)]
    long_prompt = random_prompt(60, seed=99)
    what = "llama, 3 short requests decoding, then a 60-token prompt with chunked_prefill_size=16"
    with sampling_spy(what) as sampled, torch.inference_mode():
        reqs = [engine.add_request(p, greedy(20)) for p in short]
        engine.step()  # the short ones are prefilled together and start decoding
        long_req = engine.add_request(long_prompt, greedy(6))
        chunks_seen = 0
        for _ in capped_steps(engine):
            before = len(recorder.passes)
            outputs = engine.step()
            engine.scheduler.check_invariants()
            extend_lens, prefix_lens = recorder.passes[before]
            if engine.scheduler.chunked_req is long_req:
                chunks_seen += 1
                assert long_req.rid not in [out.rid for out in outputs], (
                    f"{what}: a step reported a token for the long request mid-prefill"
                )
                decodes = sum(1 for e in extend_lens if e == 1)
                assert 16 in extend_lens and decodes == 3, (
                    f"{what}: while the long prompt is chunked, each pass should hold its 16-token chunk AND the "
                    "running "
                    f"requests' decode rows; this one had extend_lens {extend_lens}"
                )
    assert chunks_seen == 3, (
        f"{what}: the 60-token prompt (chunks of 16, 16, 16, 12) should stay half-prefilled for 3 steps, it did for "
        f"{chunks_seen}"
    )
    for i, (req, prompt) in enumerate(zip(reqs + [long_req], short + [long_prompt])):
        n = req.sampling_params.max_new_tokens
        assert_same_tokens(req.output_ids, hf_greedy(path, prompt, n), f"{what}: request {i} vs transformers (alone)")
    assert sampled.count(long_req.rid) == 6, (
        f"{what}: the long request should be sampled exactly once per generated token (6), it was sampled "
        f"{sampled.count(long_req.rid)} times"
    )


def test_the_half_prefilled_request_keeps_its_place(tiny_models_root):
    """Its next chunk comes before any waiting request; a request arriving later waits for the
    long prompt's last chunk (with only the budget left over in that step)."""
    path = tiny_models_root / "qwen3"
    budget = 10
    engine, recorder = chunked_engine(path, budget, pool_size=1024, schedule_policy="lpm")
    long_prompt, late = random_prompt(45, seed=1), random_prompt(4, seed=2)
    what = f"qwen3, a 45-token prompt with chunked_prefill_size={budget}, a 4-token one arriving during its chunks"
    with torch.inference_mode():
        long_req = engine.add_request(long_prompt, greedy(3))
        engine.step()
        late_req = engine.add_request(late, greedy(3))
        steps = 1
        for _ in capped_steps(engine):
            engine.step()
            steps += 1
            engine.scheduler.check_invariants()
            if steps <= 4:
                assert late_req.req_pool_idx is None, (
                    f"{what}: after step {steps} the late request was admitted while the long prompt still had chunks "
                    "to go: the half-prefilled request's next chunk takes the step's budget first"
                )
    prefixes = [prefix_lens for _, prefix_lens in recorder.passes[:5]]
    assert [p[0] for p in prefixes] == [0, 10, 20, 30, 40], (
        f"{what}: the long prompt's chunks should start at 0, 10, 20, 30, 40 in five consecutive passes; "
        f"the first row of each pass started at {[p[0] for p in prefixes]}"
    )
    assert recorder.passes[4][0] == [5, 4], (
        f"{what}: the last chunk (5 tokens) leaves 5 of the budget, enough for the late 4-token prompt in the same "
        "pass; "
        f"pass 5 had extend_lens {recorder.passes[4][0]}"
    )
    for req, prompt in ((long_req, long_prompt), (late_req, late)):
        assert_same_tokens(req.output_ids, hf_greedy(path, prompt, 3), f"{what}: request {req.rid} vs transformers")


def test_a_step_reports_no_token_for_a_request_mid_prefill(tiny_models_root):
    path = tiny_models_root / "qwen2"
    engine, _ = chunked_engine(path, 4, pool_size=512)
    what = "qwen2, chunked_prefill_size=4, prompts of 9, 13 and 2 tokens"
    prompts = [random_prompt(n, seed=n) for n in (9, 13, 2)]
    reqs = run_checked(engine, prompts, greedy(4), what)
    for req in reqs:
        first = req.time_stats.first_token
        assert first is not None and len(req.output_ids) == 4, (
            f"{what}: request {req.rid} ended with {len(req.output_ids)} tokens"
        )
        assert len(req.time_stats.scheduled) == 1, (
            f"{what}: request {req.rid} was admitted {len(req.time_stats.scheduled)} times"
        )


def test_chunked_prefill_size_none_computes_every_prompt_whole(tiny_models_root):
    path = tiny_models_root / "llama3"
    engine, recorder = chunked_engine(path, None, pool_size=512, max_prefill_tokens=16)
    prompts = [random_prompt(40, seed=40), random_prompt(6, seed=6)]
    what = "llama3, chunked_prefill_size=None (no chunking), max_prefill_tokens=16, prompts of 40 and 6 tokens"
    reqs = run_checked(engine, prompts, greedy(4), what)
    prefill_rows = [
        [e for e, p in zip(extend_lens, prefix_lens) if p == 0] for extend_lens, prefix_lens in recorder.passes
    ]
    assert prefill_rows[0] == [40], (
        f"{what}: chunked_prefill_size=None turns chunking off (stage 6's behaviour): the 40-token prompt is computed "
        "whole in one pass, as its step's only prefill since it is longer than max_prefill_tokens; the passes' "
        "prefill rows "
        f"were {[rows for rows in prefill_rows if rows]}"
    )
    for req, prompt in zip(reqs, prompts):
        assert_same_tokens(req.output_ids, hf_greedy(path, prompt, 4), f"{what}: request {req.rid} vs transformers")
