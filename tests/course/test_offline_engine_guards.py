"""The offline engine's guards on the reference (not graded): a request the model cannot take
is refused with the reason while the others run, and a generate() that raises midway leaves the
engine idle and whole, ready for the next call (stage 4's static batch included)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.engine import generate as naive_generate
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool.engine import StaticBatchEngine
from s05_continuous_batching.engine import ContinuousBatchingEngine
from s08_cuda_graph.engine import CudaGraphEngine
from s10_overlap_scheduling.engine import OverlapEngine
from s11_structured_output.engine import Engine as StructuredEngine
from tiny_models import VOCAB_SIZE

GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
PROMPTS = [list(b"one prompt"), list(b"and another")]
ENGINES = [ContinuousBatchingEngine, CudaGraphEngine, OverlapEngine, StructuredEngine]


def make_engine(engine_class, path: str):
    # Stage 10 and 11 with overlap on (on this CPU it is off by default): the failed step is
    # then the one in flight on the worker thread.
    knobs = {} if engine_class in (ContinuousBatchingEngine, CudaGraphEngine) else {"disable_overlap": False}
    return engine_class(engine_model(path), engine_tokenizer(path), pool_size=512, **knobs)


def fail_on_the_third_pass(runner, raised: BaseException, monkeypatch) -> tuple[Callable, list[int]]:
    """Make ``runner.forward`` raise ``raised`` on its third call; returns the real forward and
    the list of calls so far."""
    forward, calls = runner.forward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise raised
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", failing)
    return forward, calls


def idle_and_free(engine) -> None:
    assert not engine.has_work, "the engine should be idle"
    engine.scheduler.check_invariants()
    allocator, rows = engine.runner.allocator, engine.runner.req_to_token_pool
    room = engine.scheduler.available_slots()  # free, or in the prefix cache and evictable
    assert room == allocator.size, f"{allocator.size - room} KV slots are still taken"
    assert rows.available_size() == rows.size, f"{rows.size - rows.available_size()} request rows are still taken"


@pytest.mark.parametrize("engine_class", ENGINES, ids=lambda c: c.__name__)
def test_ids_and_top_k_beyond_the_vocabulary_are_refused_and_the_others_run(tiny_models_root, engine_class):
    path = str(tiny_models_root / "llama")
    engine = make_engine(engine_class, path)
    alone = [out.output_ids for out in engine.generate(PROMPTS, GREEDY)]
    bad_prompts = [[1, VOCAB_SIZE], [-1, 2], [1, 10**12]]
    huge_top_k = SamplingParams(top_k=10**20, max_new_tokens=4)  # past int64: the sampler's tensors overflow
    outputs = engine.generate(
        [PROMPTS[0], *bad_prompts, list(b"x"), PROMPTS[1]], [GREEDY, GREEDY, GREEDY, GREEDY, huge_top_k, GREEDY]
    )
    for out in outputs[1:4]:
        assert out.finish_reason.type == "abort" and out.output_ids == [], out
        assert f"[0, {VOCAB_SIZE}) (the model's vocabulary)" in out.error, out.error
    assert outputs[4].finish_reason.type == "abort" and "top_k must be -1 (off) or in [1, " in outputs[4].error
    assert [outputs[0].output_ids, outputs[5].output_ids] == alone, "the servable requests should run as if alone"
    idle_and_free(engine)


@pytest.mark.parametrize("raised", [RuntimeError("the forward pass failed"), KeyboardInterrupt()], ids=repr)
@pytest.mark.parametrize("engine_class", ENGINES, ids=lambda c: c.__name__)
def test_a_generate_that_raises_midway_leaves_the_engine_idle(tiny_models_root, engine_class, raised, monkeypatch):
    path = str(tiny_models_root / "llama")
    engine = make_engine(engine_class, path)
    expected = [out.output_ids for out in engine.generate(PROMPTS, GREEDY)]
    forward, calls = fail_on_the_third_pass(engine.runner, raised, monkeypatch)
    with pytest.raises(type(raised)):
        engine.generate([*PROMPTS, list(b"a third, waiting")], GREEDY)
    assert len(calls) >= 3  # with overlap the next pass may have started before the failure surfaced
    idle_and_free(engine)
    monkeypatch.setattr(engine.runner, "forward", forward)
    assert [out.output_ids for out in engine.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize("raised", [RuntimeError("the forward pass failed"), KeyboardInterrupt()], ids=repr)
def test_a_static_batch_that_raises_midway_leaves_the_engine_empty(tiny_models_root, raised, monkeypatch):
    path = str(tiny_models_root / "llama")
    engine = StaticBatchEngine(engine_model(path), pool_size=512, page_size=4, max_running_requests=4)
    tokenizer = engine_tokenizer(path)
    expected = [out.output_ids for out in engine.generate(tokenizer, PROMPTS, GREEDY)]
    forward, _ = fail_on_the_third_pass(engine.runner, raised, monkeypatch)
    with pytest.raises(type(raised)):
        engine.generate(tokenizer, [*PROMPTS, list(b"a third")], GREEDY)
    assert engine.running == [], "the failed batch should be aborted"
    rows, allocator = engine.runner.req_to_token_pool, engine.runner.allocator
    assert allocator.available_size() == allocator.size, f"{allocator.size - allocator.available_size()} slots leaked"
    assert rows.available_size() == rows.size, f"{rows.size - rows.available_size()} request rows are still taken"
    monkeypatch.setattr(engine.runner, "forward", forward)
    assert [out.output_ids for out in engine.generate(tokenizer, PROMPTS, GREEDY)] == expected


def test_stage_2s_generate_refuses_an_id_beyond_the_vocabulary(tiny_models_root):
    path = str(tiny_models_root / "llama")
    with torch.inference_mode(), pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 259\)"):
        naive_generate(engine_model(path), engine_tokenizer(path), [[1, 2, 259]], GREEDY)
