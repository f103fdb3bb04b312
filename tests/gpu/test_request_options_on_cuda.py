"""Every request option on CUDA (not graded; run by `make gpu-check-full`): penalties, logit_bias
and min_new_tokens, seeded top-k / top-p / min-p, log-probabilities of the output and of the
prompt, and grammars, through the engine `make serve` runs (stage 11's: graphs replayed, overlapped
and not).

Each reaches the logits in its own way: a penalty's counts kept on the logits' device, a row's
log-probabilities read where the logits are, a prompt's rows picked out of an extend, a grammar's
bitmask applied to them. The CPU tests run all of it on one device, so a tensor made on the wrong
one, or a dtype bfloat16 refuses, shows only here. In float32 the answers must be the CPU's own:
stage 3's tokens, transformers' log-probabilities, the CPU engine's constrained tokens. In bfloat16
(the server's dtype on a GPU) they must keep their promises: a banned token never comes, a forced
one does, a grammar's output parses, every log-probability is finite and names its token.

On a CPU machine every test here is an explicit skip that says why; under ENGINE_REQUIRE_GPU=1 a
missing GPU is a failure instead.
"""

from __future__ import annotations

import math

import pytest
import torch

from penalty_cases import assert_penalties_like_stage3, penalised_params
from prompt_logprob_cases import PROMPTS as SCORED_PROMPTS
from prompt_logprob_cases import assert_prompt_logprobs_case, prompt_logprob_params
from reference import assert_logprobs_match, assert_same_tokens, engine_model, engine_tokenizer
from s00_foundation.loader import load_model
from s02_request_and_sampling.sampling_params import SamplingParams
from s11_structured_output.engine import Engine
from stage10.overlap_helpers import random_prompt
from stage11.structured_helpers import REGEXES, SCHEMAS, assert_follows, constrained, mixed_workload

GRAPHS = dict(disable_cuda_graph=False, cuda_graph_max_bs=8)
# chunked: prompts in chunks beside decodes (MIXED passes); small-pool: retraction too, so each
# request's sampling state (penalty counts, seeded generator, min_new_tokens' count) must survive
# being put back and resumed
KNOBS = {
    "chunked": dict(pool_size=2048, chunked_prefill_size=8),
    "small-pool": dict(pool_size=64, max_running_requests=6, new_token_ratio=0.0, chunked_prefill_size=5),
}


def sampled_params() -> list[SamplingParams]:
    """Seeded draws through each filter, each asking for log-probabilities."""
    return [
        SamplingParams(temperature=0.9, seed=11, top_k=20, max_new_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, seed=12, top_p=0.8, max_new_tokens=9, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.7, seed=13, min_p=0.1, top_k=50, max_new_tokens=15, ignore_eos=True, logprobs=5),
    ]


def graph_replays(engine: Engine) -> int:
    return engine.runner.forward_paths.get("graph", 0)


@pytest.mark.parametrize("knobs", list(KNOBS))
@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_float32_request_options_on_cuda_equal_the_cpu(cuda_device, tiny_models_root, disable_overlap, knobs):
    path = tiny_models_root / "qwen3"  # grouped KV heads and q/k norms: the most the tiny families hold
    model = load_model(path, device=cuda_device, dtype=torch.float32)
    tokenizer = engine_tokenizer(str(path))
    engine = Engine(model, tokenizer, disable_overlap=disable_overlap, **GRAPHS, **KNOBS[knobs])
    what = f"qwen3 on CUDA, float32, {knobs}, {'no ' if disable_overlap else ''}overlap"

    params = penalised_params() + sampled_params()
    prompts = [random_prompt(3 + 4 * i, seed=70 + i) for i in range(len(params))]
    outputs = engine.generate(prompts, params)
    assert graph_replays(engine) > 0, f"{what}: no decode replayed a graph: {engine.runner.forward_paths}"
    if knobs == "small-pool":
        assert engine.scheduler.stats.num_retractions > 0, f"{what}: the pool was meant to be too small"
    assert_penalties_like_stage3(path, prompts, params, outputs, what)  # stage 3 on the CPU
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outputs)):
        if p.logprobs is not None:
            assert_logprobs_match(path, prompt, out, p.logprobs, f"{what}: request {i}")
    engine.scheduler.check_invariants()
    if knobs == "small-pool":  # (its 64 slots cannot hold the scored prompts beside each other)
        return

    # The prompts' rows come out of the extends, in chunks, never out of a graph; run twice, the
    # second time with the shared prefix in the radix tree.
    for run in ("first run", "again, prompts cached"):
        scored = engine.generate(SCORED_PROMPTS, prompt_logprob_params())
        assert_prompt_logprobs_case(path, scored, f"{what}, prompt_logprobs, {run}")
    engine.scheduler.check_invariants()


def test_float32_grammars_on_cuda_equal_the_cpu(cuda_device, tiny_models_root):
    path = tiny_models_root / "llama"
    tokenizer = engine_tokenizer(str(path))
    prompts, params, specs = mixed_workload()
    on_cpu = Engine(engine_model(str(path)), tokenizer, pool_size=2048, disable_overlap=True)
    expected = on_cpu.generate(prompts, params)
    model = load_model(path, device=cuda_device, dtype=torch.float32)
    for disable_overlap in (False, True):
        what = f"llama on CUDA, float32, {'no ' if disable_overlap else ''}overlap"
        engine = Engine(model, tokenizer, pool_size=2048, disable_overlap=disable_overlap, **GRAPHS)
        outputs = engine.generate(prompts, params)
        assert graph_replays(engine) > 0, f"{what}: no decode replayed a graph: {engine.runner.forward_paths}"
        for i, (out, want, spec) in enumerate(zip(outputs, expected, specs)):
            name = spec[2] if spec else "free"
            assert_same_tokens(out.output_ids, want.output_ids, f"{what}: request {i} ({name}) vs the CPU", tokenizer)
            if spec is not None:
                assert_follows(out.text, out.finish_reason, spec[0], spec[1], f"{what}: request {i}")
        engine.scheduler.check_invariants()


def assert_sound_logprobs(entries, token_ids, k: int, what: str) -> None:
    """Entries a bfloat16 run can be held to without a float32 reference: one per token, naming it,
    finite and <= 0, k alternatives most likely first."""
    assert entries is not None and [e.token_id for e in entries] == list(token_ids), (
        f"{what}: the entries name {None if entries is None else [e.token_id for e in entries]}, the tokens are "
        f"{list(token_ids)}"
    )
    for i, e in enumerate(entries):
        values = [e.logprob] + [v for _, v in e.top]
        assert all(math.isfinite(v) and v <= 1e-6 for v in values), f"{what}: entry {i} holds {e}"
        assert len(e.top) == k and [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True), (
            f"{what}: entry {i} should list the {k} likeliest tokens, most likely first: {e.top}"
        )


def test_bfloat16_request_options_on_cuda_keep_their_promises(cuda_device, default_model_dir):
    tokenizer = engine_tokenizer(str(default_model_dir))
    model = load_model(default_model_dir, device=cuda_device, dtype=torch.bfloat16)  # what the server runs on CUDA
    engine = Engine(model, tokenizer, pool_size=8192, **GRAPHS)
    what = "the default model on CUDA, bfloat16"
    ask = [tokenizer.encode_prompt(q) for q in ("Name three colours.", "Describe a cat.", "Count to five.")]
    # Banned: the token the model answers the first question with; forced: one it would not write.
    [unbiased] = engine.generate([ask[0]], SamplingParams(temperature=0, max_new_tokens=1))
    banned, forced = unbiased.output_ids[0], tokenizer.encode(" banana")[0]
    params = [
        SamplingParams(temperature=0, max_new_tokens=24, logit_bias={banned: -100.0}, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.8, seed=5, top_p=0.9, max_new_tokens=24, repetition_penalty=1.3, logprobs=0),
        SamplingParams(
            temperature=0, max_new_tokens=8, logit_bias={forced: 100.0}, min_new_tokens=2, stop_token_ids=[forced]
        ),
        SamplingParams(
            temperature=0.7,
            seed=6,
            top_k=40,
            min_p=0.05,
            max_new_tokens=24,
            frequency_penalty=1.5,
            presence_penalty=0.5,
        ),
        constrained("json", SCHEMAS["nested"], max_new_tokens=64),
        constrained("regex", REGEXES[1], temperature=1.0, seed=8),
    ]
    prompts = [ask[i % len(ask)] for i in range(len(params))]
    outputs = engine.generate(prompts, params)
    assert graph_replays(engine) > 0, f"{what}: no decode replayed a graph: {engine.runner.forward_paths}"

    assert banned not in outputs[0].output_ids, f"{what}: logit_bias -100 banned {banned}, yet it came"
    assert_sound_logprobs(outputs[0].logprobs, outputs[0].output_ids, 2, f"{what}: request 0's logprobs")
    assert_sound_logprobs(outputs[0].prompt_logprobs[1:], prompts[0][1:], 1, f"{what}: request 0's prompt_logprobs")
    assert_sound_logprobs(outputs[1].logprobs, outputs[1].output_ids, 0, f"{what}: request 1's logprobs")
    assert len(outputs[2].output_ids) == 3 and outputs[2].output_ids.index(forced) == 2, (
        f"{what}: logit_bias +100 forces {forced}, a stop token banned for the first 2 tokens: the third ends the "
        f"request, got {outputs[2].output_ids}"
    )
    assert outputs[3].output_ids and outputs[3].finish_reason is not None, f"{what}: request 3 ended as {outputs[3]}"
    assert_follows(outputs[4].text, outputs[4].finish_reason, "json", SCHEMAS["nested"], f"{what}: request 4")
    assert_follows(outputs[5].text, outputs[5].finish_reason, "regex", REGEXES[1], f"{what}: request 5")
    engine.scheduler.check_invariants()
