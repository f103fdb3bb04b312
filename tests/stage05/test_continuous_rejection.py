"""Stage 5 (graded): a request that could never be served - a prompt longer than the KV pool or
the model's context - is refused with a clear error, and the other requests do not notice."""

from __future__ import annotations

import pytest

from continuous_helpers import assert_pool_free, greedy, tiny_engine
from invariants import capped_steps
from reference import assert_same_tokens, hf_greedy
from s02_request_and_sampling.req import Req

OK_PROMPTS = [list(b"fine"), list(b"also fine, a bit longer"), list(b"ok")]


def check_others(path, outputs, indices):
    for i in indices:
        out = outputs[i]
        prompt = OK_PROMPTS[indices.index(i)]
        assert out.error is None and out.finish_reason.type == "length", (
            f"request {i} is servable: it should finish normally, got finish reason {out.finish_reason}, error "
            f"{out.error!r}"
        )
        assert_same_tokens(out.output_ids, hf_greedy(path, prompt, 8), f"request {i}, next to rejected requests")


def test_prompts_longer_than_the_pool_or_the_context_are_rejected(tiny_models_root):
    path = tiny_models_root / "qwen2"  # its context is 1024 positions
    engine, _, _ = tiny_engine(path, pool_size=2048, max_running_requests=4)
    too_long_for_context = list(b"y" * 1100)
    outputs = engine.generate([OK_PROMPTS[0], too_long_for_context, OK_PROMPTS[1], OK_PROMPTS[2]], greedy(8))
    bad = outputs[1]
    assert bad.finish_reason.type == "abort" and bad.output_ids == [] and bad.error, (
        "a 1100-token prompt exceeds the model's 1024-token context: its output should be an abort with no tokens "
        "and an "
        f"error message, got finish reason {bad.finish_reason}, {len(bad.output_ids)} tokens, error {bad.error!r}"
    )
    assert "1100" in bad.error and "1024" in bad.error, (
        f"the error should give the prompt length and the context: {bad.error!r}"
    )
    check_others(path, outputs, [0, 2, 3])
    assert_pool_free(engine, "after a rejected request")

    small, _, _ = tiny_engine(path, pool_size=64, max_running_requests=4)
    too_long_for_pool = list(b"z" * 100)
    outputs = small.generate([OK_PROMPTS[0], OK_PROMPTS[1], too_long_for_pool, OK_PROMPTS[2]], greedy(8))
    bad = outputs[2]
    assert bad.finish_reason.type == "abort" and bad.output_ids == [] and bad.error, (
        "a 100-token prompt cannot fit a 64-slot KV pool: its output should be an abort with an error message, "
        f"got finish reason {bad.finish_reason}, error {bad.error!r}"
    )
    assert "64" in bad.error and "pool" in bad.error, f"the error should say how big the KV pool is: {bad.error!r}"
    check_others(path, outputs, [0, 1, 3])
    assert_pool_free(small, "after a rejected request")


def test_add_request_refuses_what_can_never_finish(tiny_models_root):
    path = tiny_models_root / "llama"
    engine, _, _ = tiny_engine(path, pool_size=64, max_running_requests=4)
    engine.add_request(OK_PROMPTS[0], greedy(8), rid="ok")
    scheduler = engine.scheduler
    for prompt, n, what in (
        (list(b"w" * 40), 30, "prompt + max_new_tokens over the 64-slot pool"),
        (list(b"v" * 10), 2000, "prompt + max_new_tokens over the 1024-token context"),
    ):
        req = Req(rid="bad", origin_input_ids=prompt, sampling_params=greedy(n))
        with pytest.raises(ValueError) as error:
            scheduler.add_request(req)
        assert "bad" in str(error.value), f"{what}: the error should name the request, got: {error.value}"
        assert [r.rid for r in scheduler.waiting] == ["ok"], f"{what}: a refused request must not be queued"
    outputs = {}
    for _ in capped_steps(engine):
        for out in engine.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    assert_same_tokens(outputs["ok"], hf_greedy(path, OK_PROMPTS[0], 8), "request 'ok' after two refused requests")
    assert_pool_free(engine, "after refused requests")
