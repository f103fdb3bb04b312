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
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graph_helpers import prompts_of, run_pass, runners, start
from reference import engine_model

HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
FROM_PYTHON_DATA = {"tensor", "as_tensor", "from_numpy"}
DATA_DEPENDENT_SHAPES = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                         "_local_scalar_dense", "lift_fresh", "lift_fresh_copy"}


class FunctionWatch(TorchFunctionMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            self.found.append(f"Tensor.{name}() reads a device value on the host")
        elif name in FROM_PYTHON_DATA:
            self.found.append(f"torch.{name}(...) builds a tensor from Python data")
        return func(*args, **(kwargs or {}))


class DispatchWatch(TorchDispatchMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in DATA_DEPENDENT_SHAPES:
            self.found.append(f"aten.{name}: a result whose shape or value is read from the data")
        elif name in ("index", "index_put_", "index_put") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) if i is not None
        ):
            self.found.append(f"aten.{name} with a boolean mask: a result shape that depends on the data")
        return func(*args, **(kwargs or {}))


class WatchedModel:
    """Stands in for the graph runner's model: runs it, and notes everything not capturable."""

    def __init__(self, model):
        self.model, self.found, self.calls = model, [], 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        with FunctionWatch(self.found), DispatchWatch(self.found):
            return self.model(*args, **kwargs)


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
        assert runner.last_forward_path == "graph", f"a decode of {size} should take the graph path, took {runner.last_forward_path!r}"
    assert watched.calls == 7, f"the graph path should run the model once per decode, ran it {watched.calls} times"
    problems = sorted(set(watched.found))
    assert not problems, (
        "inside the region a CUDA graph records (the static batch's model pass), nothing may depend on the host "
        "or on data-dependent shapes; found:\n  " + "\n  ".join(problems)
    )


def test_the_watch_catches_what_breaks_a_capture(tiny_models_root):
    """The watch itself: a decode that reads lengths on the host is reported (so the test above can fail)."""
    runner, _ = runners(engine_model(str(tiny_models_root / "llama")))
    backend = runner.attn_backend
    original = backend.forward_decode_graph

    def host_reading_decode(q, k, v, layer_id, meta):
        lengths = torch.tensor(meta.seq_lens.tolist())  # what a per-request loop would do
        assert lengths.numel() == q.shape[0]
        return original(q, k, v, layer_id, meta)

    backend.forward_decode_graph = host_reading_decode
    watched = runner.cuda_graph_runner.model = WatchedModel(runner.cuda_graph_runner.model)
    reqs = start(runner, prompts_of(3))
    run_pass(runner, reqs)
    run_pass(runner, reqs)
    assert any("tolist" in p for p in watched.found) and any("torch.tensor" in p for p in watched.found), watched.found
