"""Stage 7 (graded): the engine's default budget, chunked_prefill_size="auto": 512 prompt tokens a
step for requests added one by one (a server streams them), 2048 inside generate() (a whole
workload returned at once), and a number or None given by the caller applies to both."""

from __future__ import annotations

import pytest
import torch

from chunked_helpers import chunked_engine, greedy, random_prompt
from invariants import capped_steps
from s07_chunked_prefill.engine import OFFLINE_CHUNKED_PREFILL_SIZE, SERVING_CHUNKED_PREFILL_SIZE

PROMPTS = [random_prompt(400, seed=i) for i in range(6)]  # 2400 prompt tokens: more than either budget


def prefill_tokens(recorded_pass) -> int:
    """Prompt tokens of one recorded pass (its decode rows extend by one token; no prompt here is
    cut into a 1-token chunk)."""
    extend_lens, _ = recorded_pass
    return sum(e for e in extend_lens if e > 1)


def first_pass_tokens(recorder, start: int) -> int:
    return prefill_tokens(recorder.passes[start])


def step_to_the_end(engine, prompts, params):
    reqs = [engine.add_request(p, params) for p in prompts]
    with torch.inference_mode():
        for _ in capped_steps(engine):
            engine.step()
    return [req.output_ids for req in reqs]


def test_generate_takes_the_offline_budget_and_the_step_api_the_serving_one(tiny_models_root):
    engine, recorder = chunked_engine(tiny_models_root / "llama", "auto", pool_size=4096)
    what = "llama, chunked_prefill_size='auto', 6 prompts of 400 tokens"

    offline = [out.output_ids for out in engine.generate(PROMPTS, greedy(3))]
    assert first_pass_tokens(recorder, 0) == OFFLINE_CHUNKED_PREFILL_SIZE, (
        f"{what}: generate()'s first pass should compute {OFFLINE_CHUNKED_PREFILL_SIZE} prompt tokens (five whole "
        f"prompts and a chunk of the sixth), it computed {first_pass_tokens(recorder, 0)}: offline, nobody reads a "
        "stream, so its steps take the offline budget, and the last prompt admitted is cut to what is left of it "
        "(prefill_len cuts to the step's budget left, not to chunked_prefill_size)"
    )
    assert max(map(prefill_tokens, recorder.passes)) <= OFFLINE_CHUNKED_PREFILL_SIZE

    engine.tree_cache.evict(engine.runner.allocator.size)  # so that the step API computes the prompts again
    start = len(recorder.passes)
    streamed = step_to_the_end(engine, PROMPTS, greedy(3))
    assert first_pass_tokens(recorder, start) == SERVING_CHUNKED_PREFILL_SIZE, (
        f"{what}: after generate() returned, the step API's first pass should compute "
        f"{SERVING_CHUNKED_PREFILL_SIZE} prompt tokens (a server's budget), it computed "
        f"{first_pass_tokens(recorder, start)}: generate() must give the step API its own budget back"
    )
    assert streamed == offline, f"{what}: the budget changed the tokens"


@pytest.mark.parametrize("budget", [64, None])
def test_a_budget_given_by_the_caller_applies_to_generate_too(tiny_models_root, budget):
    engine, recorder = chunked_engine(tiny_models_root / "qwen2", budget, pool_size=4096, max_prefill_tokens=600)
    engine.generate(PROMPTS[:3], greedy(2))
    largest = max(map(prefill_tokens, recorder.passes))
    expected = 64 if budget else 400  # None: no chunking, each prompt whole under max_prefill_tokens=600
    assert largest == expected, (
        f"qwen2, chunked_prefill_size={budget}: the largest pass of generate() computed {largest} prompt tokens, "
        f"expected {expected}: a budget the caller chose holds offline as well"
    )
