"""Stage 10 on CUDA (not graded; run by `make gpu-check-full`): the overlapped engine launches each
step on the worker's own CUDA stream, replays stage 8's graphs there, and gives the tokens of stage
8's engine and of transformers, greedy and seeded, with retraction and aborts. On a CPU machine
every test here is an explicit skip that says why; under ENGINE_REQUIRE_GPU=1 a missing GPU fails."""

from __future__ import annotations

import torch

from reference import assert_same_tokens, engine_tokenizer, hf_greedy
from s00_foundation.loader import load_model
from s02_request_and_sampling.sampling_params import SamplingParams
from s08_cuda_graph.engine import CudaGraphEngine
from s10_overlap_scheduling.engine import OverlapEngine

PROMPTS = [[65 + i] + [32 + (7 * i + 3 * j) % 90 for j in range(3 + 5 * i % 17)] for i in range(12)]


def test_overlap_on_its_cuda_stream_gives_stage_8s_tokens(cuda_device, tiny_model_dir):
    model = load_model(tiny_model_dir, device=cuda_device, dtype=torch.float32)
    tokenizer = engine_tokenizer(str(tiny_model_dir))
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, top_p=0.9, max_new_tokens=6 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    for knobs in (dict(pool_size=2048), dict(pool_size=96, max_running_requests=6, new_token_ratio=0.0, page_size=4)):
        knobs = dict(knobs, cuda_graph_max_bs=8, disable_cuda_graph=False)
        expected = [o.output_ids for o in CudaGraphEngine(model, tokenizer, **knobs).generate(PROMPTS, params)]
        engine = OverlapEngine(model, tokenizer, **knobs)
        assert engine.scheduler.enable_overlap
        got = [o.output_ids for o in engine.generate(PROMPTS, params)]
        on_cuda = cuda_device.type == "cuda"
        assert (engine.scheduler.worker.stream is not None) == on_cuda, (
            "on CUDA the worker launches on a stream of its own"
        )
        assert engine.runner.forward_paths.get("graph", 0) > 0, (
            f"no graph replayed in the worker: {engine.runner.forward_paths}"
        )
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_tokens(a, b, f"{tiny_model_dir.name} on CUDA, {knobs}: request {i} vs stage 8's engine")
        engine.scheduler.check_invariants()
    for i, prompt in enumerate(PROMPTS[1::2]):
        assert_same_tokens(
            got[2 * i + 1], hf_greedy(tiny_model_dir, prompt, 7 + 2 * i), f"greedy request {2 * i + 1} vs transformers"
        )


def test_abort_in_flight_on_cuda(cuda_device, tiny_model_dir):
    model = load_model(tiny_model_dir, device=cuda_device, dtype=torch.float32)
    engine = OverlapEngine(model, engine_tokenizer(str(tiny_model_dir)), pool_size=1024, disable_cuda_graph=False)
    greedy = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    reqs = [engine.add_request(p, greedy) for p in PROMPTS[:4]]
    with torch.inference_mode():
        for _ in range(3):
            engine.step()
        assert engine.abort_request(reqs[0].rid)
        while engine.has_work:
            engine.step()
            engine.scheduler.check_invariants()
    assert reqs[0].finished_reason.type == "abort" and all(t >= 0 for t in reqs[0].output_ids)
    for req, prompt in zip(reqs[1:], PROMPTS[1:4]):
        assert_same_tokens(req.output_ids, hf_greedy(tiny_model_dir, prompt, 20), f"request {req.rid} vs transformers")
