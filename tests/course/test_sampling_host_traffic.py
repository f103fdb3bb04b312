"""What a decode step with every sampling option on sends to the device and reads back (not
graded: it checks the reference engine, whose steps a GPU pays for; stage 8's graded test counts a
greedy step). On CUDA a tensor built from Python data with ``torch.tensor(..., device=...)`` stops
the host until the queued forward has run; the sampler's and the penalties' per-row settings go
through ``host_to_device`` instead (pinned memory, non-blocking: queued, not waited for). The
watch (tests/host_watch.py) sees every such call on a CPU and names where it was made."""

from __future__ import annotations

import pytest
import torch

from host_watch import HostWatch
from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s08_cuda_graph.engine import Engine

OPTIONS = [
    SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
    SamplingParams(
        temperature=0.8, seed=1, top_k=20, top_p=0.9, min_p=0.05, max_new_tokens=20, ignore_eos=True, logprobs=3
    ),
    SamplingParams(
        temperature=0,
        max_new_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        logit_bias={40: 2.0},
        min_new_tokens=15,
    ),
]
READS = [
    # the sampled tokens (every step), then the logprobs of the rows that asked, in one table
    ("Tensor.tolist()", "s02_request_and_sampling/engine.py in append_sampled"),
    ("Tensor.tolist()", "s02_request_and_sampling/logprobs.py in logprob_entries"),
]
# ForwardBatch's inputs and the allocator's slots (2), the sampler's temperature, top-k, top-p,
# min-p, uniform draws and greedy rows (6), the penalties' r, f and p (3); and the sampled ids
# that logprobs take with torch.as_tensor, already on the device (no copy)
COPIES = [("torch.as_tensor(...)", "s00_foundation/device.py in host_to_device")] * 11 + [
    ("torch.as_tensor(...)", "s02_request_and_sampling/logprobs.py in logprob_entries")
]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph path"])
def test_a_decode_step_with_every_option_waits_only_to_read_its_results(tiny_models_root, graphs):
    path = str(tiny_models_root / "llama")
    engine = Engine(engine_model(path), engine_tokenizer(path), pool_size=512, disable_cuda_graph=not graphs)
    for i, params in enumerate(OPTIONS):
        engine.add_request([65 + i, 66, 67, 68], params)
    with torch.inference_mode():
        for _ in range(3):  # the prefill, then decodes: every request has drawn and holds its penalty state
            engine.step()
        watch = HostWatch()
        with watch:
            engine.step()
    assert engine.runner.last_forward_path == ("graph" if graphs else "eager"), engine.runner.last_forward_path
    assert sorted(watch.reads) == sorted(READS), f"host reads of device values: expected {READS}, saw {watch.reads}"
    assert sorted(watch.from_python) == sorted(COPIES), (
        "tensors built from Python data (each a host-to-device copy on a GPU, blocking unless made by "
        f"host_to_device): expected {COPIES}, saw {watch.from_python}"
    )
