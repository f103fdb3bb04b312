"""Stage 8 (graded): what a CUDA graph records is capturable, checked on any machine.

A graph records device work and nothing else. Inside the captured region (the model pass over a
bucket's static batch, attention included):

- reading a device value on the host (``.item()``, ``.tolist()``, ``if tensor:``) stops the capture
  with an error on CUDA;
- a tensor built from Python data (``torch.tensor(batch.seq_lens)``) is, on CUDA, a host-to-device
  copy recorded once: every replay would reuse the first batch's values;
- an op whose output shape depends on the data (``nonzero``, boolean-mask indexing, ``unique``)
  cannot be recorded at all.

On a CPU the runner runs that same region eagerly, so these tests watch it through torch's
function and dispatch hooks, across buckets and padded batches, and name the offending call.

Around the region, a whole decode step of the engine is counted the same way: the host reads
(each a wait for the GPU) and host-to-device copies it makes are named, and must be the few
listed below. (The watch itself is tested in tests/course/test_capture_watch.py.)
"""

from __future__ import annotations

import pytest

from graph_helpers import prompts_of, run_pass, runners, start
from host_watch import HostWatch, WatchedModel
from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s08_cuda_graph.engine import Engine


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_the_captured_region_reads_nothing_on_the_host(tiny_models_root, family, page_size):
    runner, _ = runners(engine_model(str(tiny_models_root / family)), page_size=page_size)
    graph = runner.cuda_graph_runner
    watched = graph.model = WatchedModel(graph.model)
    reqs = start(runner, prompts_of(6))
    run_pass(runner, reqs)  # the prefill: eager, not watched
    for size in (6, 6, 5, 3, 3, 2, 1):  # buckets 8, 8, 8, 4, 4, 2, 1: padded and unpadded passes
        run_pass(runner, reqs[:size])
        assert runner.last_forward_path == "graph", (
            f"a decode of {size} should take the graph path, took {runner.last_forward_path!r}"
        )
    assert watched.calls == 7, f"the graph path should run the model once per decode, ran it {watched.calls} times"
    problems = watched.found
    assert not problems, (
        "inside the region a CUDA graph records (the static batch's model pass), nothing may depend on the host "
        "or on data-dependent shapes; found:\n  " + "\n  ".join(problems)
    )


# What a steady decode step of the engine may still do on the host, by name. Everything else
# would be a new wait for the GPU (a read) or a new host-to-device copy in every step.
HOST_READS_PER_DECODE_STEP = [
    # The sampled tokens come back to the host: the scheduler appends them, checks stop
    # conditions and streams them. The one wait a step cannot avoid (stage 10's overlap
    # scheduling hides it behind the next step's preparation).
    ("Tensor.tolist()", "s02_request_and_sampling/engine.py in append_sampled"),
]
COPIES_PER_DECODE_STEP = [
    # Both from pinned memory with non_blocking=True (s00 device.host_to_device): queued, not waited for.
    # The token ids, positions and table rows in one; the new tokens' slots (the allocator's out_cache_loc).
    ("torch.as_tensor(...)", "s00_foundation/device.py in host_to_device"),
    ("torch.as_tensor(...)", "s00_foundation/device.py in host_to_device"),
]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph path"])
def test_host_syncs_and_copies_per_decode_step(tiny_models_root, graphs):
    """A steady decode step (no request joins or leaves) reads one thing back from the device,
    the sampled tokens, and copies its inputs to the device in two non-blocking copies."""
    path = str(tiny_models_root / "llama")
    engine = Engine(
        engine_model(path), engine_tokenizer(path), pool_size=512, max_running_requests=8, disable_cuda_graph=not graphs
    )
    for i in range(3):
        engine.add_request(prompts_of(3)[i], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
    engine.step(), engine.step()  # the prefill, a first decode
    watch = HostWatch()
    with watch:
        engine.step()
    expected_path = "graph" if graphs else "eager"
    assert engine.runner.last_forward_path == expected_path, (
        f"the decode took the {engine.runner.last_forward_path!r} path"
    )
    assert sorted(watch.reads) == sorted(HOST_READS_PER_DECODE_STEP), (
        f"{expected_path} decode step: host reads of device values (each one waits for the GPU): expected only "
        f"{HOST_READS_PER_DECODE_STEP}, saw {watch.reads}"
    )
    assert sorted(watch.from_python) == sorted(COPIES_PER_DECODE_STEP), (
        f"{expected_path} decode step: tensors built from Python data (host-to-device copies on a GPU): expected the "
        f"{len(COPIES_PER_DECODE_STEP)} of host_to_device (ForwardBatch.build, the allocator), saw {watch.from_python}"
    )
