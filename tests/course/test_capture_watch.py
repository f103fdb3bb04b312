"""The watch the stage-8 tests use (tests/host_watch.py) catches what would break a CUDA graph
capture or make a GPU wait (not graded: it checks the course's own checker, so that the graded
tests built on it can fail)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stage08"))
from graph_helpers import prompts_of, run_pass, runners, start  # noqa: E402
from host_watch import HostWatch, WatchedModel  # noqa: E402
from reference import engine_model  # noqa: E402


def test_the_watch_catches_what_breaks_a_capture(tiny_models_root):
    """A decode that reads lengths on the host is reported, with the call and where it was made."""
    runner, _ = runners(engine_model(str(tiny_models_root / "llama")))
    backend = runner.attn_backend
    original = backend.forward_decode

    def host_reading_decode(q, k, v, layer_id, out_cache_loc, meta):
        lengths = torch.tensor(meta.seq_lens.tolist())  # what a per-request loop would do
        assert lengths.numel() == q.shape[0]
        return original(q, k, v, layer_id, out_cache_loc, meta)

    backend.forward_decode = host_reading_decode
    watched = runner.cuda_graph_runner.model = WatchedModel(runner.cuda_graph_runner.model)
    reqs = start(runner, prompts_of(3))
    run_pass(runner, reqs)
    run_pass(runner, reqs)
    assert any("tolist" in p for p in watched.found) and any("torch.tensor" in p for p in watched.found), watched.found


def test_the_watch_names_where_a_host_read_was_made():
    watch = HostWatch()
    with watch:
        torch.arange(3).tolist()
        torch.tensor([1, 2])
    assert watch.reads == [("Tensor.tolist()", "outside the engine")]
    assert watch.from_python == [("torch.tensor(...)", "outside the engine")]
