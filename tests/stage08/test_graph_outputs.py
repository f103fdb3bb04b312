"""Stage 8 (graded): the graph path computes what the eager path computes.

Decode logits of the real rows equal stage 4's eager runner's for the same batch (every family,
float32), the engine's greedy tokens equal transformers' and the stage-7 engine's, and prefills
and decodes larger than the biggest bucket take the eager fallback."""

from __future__ import annotations

import pytest
import torch

import prompt_logprob_cases as scored
from graph_helpers import prompts_of, run_pass, runners, start
from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy
from s02_request_and_sampling.sampling_params import SamplingParams
from s07_chunked_prefill.engine import ChunkedPrefillEngine
from s08_cuda_graph.engine import Engine


def test_decode_logits_equal_the_eager_runner(tiny_model_dir):
    model = engine_model(str(tiny_model_dir))
    graph_runner, eager_runner = runners(model, max_bs=8)
    prompts = prompts_of(6)
    ours, theirs = start(graph_runner, prompts), start(eager_runner, prompts)
    for step, size in enumerate([6, 6, 5, 3, 3, 1]):  # the prefill (eager), then buckets 8, 8, 4, 4, 1
        _, expected = run_pass(eager_runner, theirs[:size])
        tokens = expected.argmax(-1).tolist()
        _, got = run_pass(graph_runner, ours[:size], tokens)
        path = "eager (prefill)" if step == 0 else "graph"
        assert graph_runner.last_forward_path == path.split()[0], (
            f"{tiny_model_dir.name}, step {step}: expected the {path} path, the runner took "
            f"{graph_runner.last_forward_path!r}"
        )
        assert got.shape == expected.shape, (
            f"{tiny_model_dir.name}, step {step} ({size} requests): logits of shape {tuple(got.shape)}, expected "
            f"{tuple(expected.shape)}: return the real rows only, not the padding"
        )
        worst = (got - expected).abs().max().item()
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (
            f"{tiny_model_dir.name}, step {step} ({size} requests, padded to a bucket): the graph path's logits "
            "differ from "
            f"stage 4's eager runner by up to {worst:.3g}"
        )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def test_engine_greedy_equals_transformers_and_stage7(tiny_model_dir):
    path = str(tiny_model_dir)
    model, tok = engine_model(path), engine_tokenizer(path)
    prompts = prompts_of(6)
    limits = [9, 4, 12, 6, 10, 7]
    # 6 requests, graphs up to 4: decodes of 5-6 requests run eagerly, 1-4 replay the graph path.
    engine = Engine(model, tok, pool_size=512, max_running_requests=8, cuda_graph_max_bs=4, disable_cuda_graph=False)
    got = engine.generate(prompts, [greedy(n) for n in limits])
    stage7 = ChunkedPrefillEngine(model, tok, pool_size=512, max_running_requests=8).generate(
        prompts, [greedy(n) for n in limits]
    )
    for i, (prompt, n) in enumerate(zip(prompts, limits)):
        what = f"{tiny_model_dir.name}, request {i} ({len(prompt)}-token prompt, {n} new tokens)"
        assert_same_tokens(got[i].output_ids, hf_greedy(path, prompt, n), f"{what}, stage 8 vs transformers")
        assert_same_tokens(got[i].output_ids, stage7[i].output_ids, f"{what}, stage 8 vs the stage-7 engine")
    paths = engine.runner.forward_paths
    assert paths["graph"] > 0 and paths["eager"] > 0, (
        f"{tiny_model_dir.name}: this workload has prefills, decodes of 5-6 requests (> cuda_graph_max_bs=4) and "
        "decodes "
        f"of 1-4; both paths should have run, got {dict(paths)}"
    )


def test_fallback_paths(tiny_models_root):
    model = engine_model(str(tiny_models_root / "llama3"))
    runner, _ = runners(model, max_bs=4)
    reqs = start(runner, prompts_of(6))
    expected_paths = []
    run_pass(runner, reqs[:4])
    expected_paths.append(("a prefill of 4 requests", "eager"))
    observed = [runner.last_forward_path]
    run_pass(runner, reqs[:4])
    expected_paths.append(("a decode of 4 requests (the largest bucket)", "graph"))
    observed.append(runner.last_forward_path)
    run_pass(runner, reqs)
    expected_paths.append(("a batch of 4 decodes and 2 prefills", "eager"))
    observed.append(runner.last_forward_path)
    run_pass(runner, reqs)
    expected_paths.append(("a decode of 6 requests (> cuda_graph_max_bs=4)", "eager"))
    observed.append(runner.last_forward_path)
    run_pass(runner, reqs[:2])
    expected_paths.append(("a decode of 2 requests", "graph"))
    observed.append(runner.last_forward_path)
    for (what, expected), got in zip(expected_paths, observed):
        assert got == expected, f"{what} should take the {expected} path, took {got!r}"
    assert runner.forward_paths == {"eager": 3, "graph": 2}, (
        f"path counts: expected 3 eager and 2 graph passes, got {dict(runner.forward_paths)}"
    )


def test_disable_cuda_graph_runs_everything_eagerly(tiny_models_root):
    path = str(tiny_models_root / "qwen3")
    model, tok = engine_model(path), engine_tokenizer(path)
    engine = Engine(model, tok, pool_size=256, disable_cuda_graph=True)
    got = engine.generate(prompts_of(2), greedy(5))
    assert engine.runner.cuda_graph_runner is None, "disable_cuda_graph=True: the runner should have no CudaGraphRunner"
    assert set(engine.runner.forward_paths) == {"eager"}, (
        f"disable_cuda_graph=True: every pass eager, got {dict(engine.runner.forward_paths)}"
    )
    for i, prompt in enumerate(prompts_of(2)):
        assert_same_tokens(got[i].output_ids, hf_greedy(path, prompt, 5), f"qwen3, request {i}, graphs disabled")


def test_default_uses_graphs_only_on_cuda(tiny_models_root):
    """Nothing is captured on a CPU, where the padded static path only costs: the default engine
    runs eagerly there (and replays graphs on CUDA)."""
    path = str(tiny_models_root / "llama")
    model, tok = engine_model(path), engine_tokenizer(path)
    engine = Engine(model, tok, pool_size=256)
    got = engine.generate(prompts_of(2), greedy(4))
    on_cuda = model.device.type == "cuda"
    assert (engine.runner.cuda_graph_runner is not None) == on_cuda, (
        f"the default engine on {model.device.type} should {'' if on_cuda else 'not '}have a CudaGraphRunner"
    )
    expected = {"eager", "graph"} if on_cuda else {"eager"}
    assert set(engine.runner.forward_paths) == expected, (
        f"default engine on {model.device.type}: paths {dict(engine.runner.forward_paths)}"
    )
    for i, prompt in enumerate(prompts_of(2)):
        assert_same_tokens(got[i].output_ids, hf_greedy(path, prompt, 4), f"llama, request {i}, default engine")


@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_across_key_length_buckets_and_pages(tiny_models_root, page_size):
    path = str(tiny_models_root / "qwen3")
    model, tok = engine_model(path), engine_tokenizer(path)
    shared = [32 + (7 * j) % 90 for j in range(58)]  # a 58-token prefix the radix cache shares
    prompts = [shared + [65 + i] for i in range(3)] + [[70, 71, 72]]
    limits = [12, 8, 10, 5]  # the longest crosses 64 tokens in context: key-length bucket 64, then 128
    engine = Engine(model, tok, pool_size=512, page_size=page_size, max_running_requests=4, disable_cuda_graph=False)
    graph = engine.runner.cuda_graph_runner
    used, prepare = set(), graph.replay_prepare  # every bucket is set up at start: record the ones decodes take

    def recording(forward_batch):
        bucket = prepare(forward_batch)
        used.add(bucket)
        return bucket

    graph.replay_prepare = recording
    got = engine.generate(prompts, [greedy(n) for n in limits])
    assert {kv for _, kv in used} >= {64, 128}, (
        f"page_size {page_size}: the decodes should have used key-length buckets 64 and 128, used {sorted(used)}"
    )
    for i, (prompt, n) in enumerate(zip(prompts, limits)):
        what = f"qwen3, page_size {page_size}, request {i} ({len(prompt)}-token prompt, {n} new tokens)"
        assert_same_tokens(got[i].output_ids, hf_greedy(path, prompt, n), f"{what}, stage 8 vs transformers")
    engine.scheduler.check_invariants()


def test_passes_that_score_prompts_run_eagerly(tiny_models_root):
    """A graph's output holds one row per request, so a pass that also returns prompt rows never
    replays one, even when every request sends one token (chunks of one): it runs eagerly; the
    decodes around it still replay graphs."""
    path = tiny_models_root / "llama_gqa_bias"
    engine = Engine(
        engine_model(str(path)), engine_tokenizer(str(path)), chunked_prefill_size=1, disable_cuda_graph=False
    )
    scored.assert_prompt_logprobs_case(
        path, engine.generate(scored.PROMPTS, scored.prompt_logprob_params()), "stage 8 with graphs"
    )
    paths = engine.runner.forward_paths
    assert paths["graph"] > 0 and paths["eager"] > 0, (
        f"the decodes should replay graphs and the passes scoring prompts run eagerly; paths taken: {dict(paths)}"
    )
