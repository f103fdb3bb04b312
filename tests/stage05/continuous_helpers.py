"""Shared by the stage-5 tests: a tiny-model engine whose forward passes and steps are recorded."""

from __future__ import annotations

import random

import torch

from recording import PassRecorder
from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.engine import Engine


def tiny_engine(path, **knobs):
    """(engine, recorder, traces) on a tiny model; knobs go to Engine (pool_size, ...)."""
    recorder = PassRecorder(engine_model(str(path)))
    traces = []
    engine = Engine(recorder, engine_tokenizer(str(path)), trace=traces.append, **knobs)
    return engine, recorder, traces


def greedy(max_new_tokens: int) -> SamplingParams:
    # ignore_eos: the tiny random models may emit their EOS id; the references run to the limit too
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


def workload(count: int, seed: int, max_prompt: int = 48, max_new: int = 16):
    """``count`` prompts of byte tokens with lengths in 1..max_prompt and limits in 1..max_new."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(32, 127) for _ in range(rng.randint(1, max_prompt))] for _ in range(count)]
    limits = [rng.randint(1, max_new) for _ in range(count)]
    return prompts, limits


def retraction_workload():
    """Ten requests that outgrow a 128-slot pool when admitted with new_token_ratio=0."""
    prompts, limits = workload(10, seed=11, max_prompt=24, max_new=24)
    return prompts, [max(n, 14) for n in limits]  # long enough that the running requests outgrow the pool


def run_to_end(engine, check_every_step: bool = True, max_steps: int = 10_000):
    """Step the engine until it has no work, checking the scheduler's invariants after each step."""
    steps = 0
    with torch.inference_mode():
        while engine.has_work:
            finished = [out.rid for out in engine.step() if out.finish_reason is not None]
            steps += 1
            if check_every_step:
                behind = [req for req in engine.scheduler.running if req.cached_len != req.device_len - 1]
                assert not behind, (
                    f"after step {steps}: request {behind[0].rid} has {behind[0].device_len} tokens and the K/V of "
                    f"cached_len={behind[0].cached_len} of them; after its pass all but the token just sampled have "
                    "K/V, so process_batch_result sets req.cached_len = req.device_len before that token is appended "
                    "(else the slots past cached_len belong to nobody)"
                )
                try:
                    engine.scheduler.check_invariants()
                except AssertionError as error:
                    raise AssertionError(
                        f"after step {steps} (requests that finished in it: {finished}; a finished request is released "
                        f"in the step it finishes, its slots and table row freed at once): {error}"
                    ) from None
            assert steps < max_steps, f"the engine still has work after {max_steps} steps: is a request stuck?"
    return steps


def assert_pool_free(engine, what: str) -> None:
    engine.scheduler.check_invariants()
    runner = engine.runner
    free, size = runner.allocator.available_size(), runner.allocator.size
    assert free == size, f"{what}: after the workload {size - free} of {size} KV slots are still taken (a leak)"
    rows = runner.req_to_token_pool
    assert rows.available_size() == rows.size, (
        f"{what}: after the workload {rows.size - rows.available_size()} request rows are still taken"
    )
