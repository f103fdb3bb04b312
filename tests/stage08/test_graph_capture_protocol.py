"""Stage 8 (graded): the capture itself, on any machine, against a stand-in for torch.cuda.

A CPU cannot record a CUDA graph, but the capture's protocol can be checked anywhere. These tests
swap torch.cuda's stream and graph API for stand-ins that behave as CUDA does where it matters:

- work queued inside ``with torch.cuda.graph(g, pool=...)`` runs once and is recorded by ``g``;
- ``g.replay()`` runs the recorded pass again, on the same input tensors, and writes its result
  into the same output tensor the capture returned (a graph has fixed addresses, not return values).
  Unlike CUDA it re-runs the pass's Python too; that the pass holds nothing but device work is
  test_graph_capturable.py's concern.

Then the runner is told it is on CUDA and must: warm each bucket up ``NUM_WARMUP_RUNS`` times on a
side stream before recording it, record one pass per bucket into the one shared memory pool, keep
the graph and its output, and answer every later decode of that bucket by replaying it, with the
same logits as stage 4's eager runner. ``make test-gpu`` checks the same on a real GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from graph_helpers import prompts_of, run_pass, runners, start
from reference import engine_model
from s04_paged_kv_pool.engine import prepare_forward
from s08_cuda_graph import cuda_graph_runner as cgr


class FakeStream:
    def __init__(self, name: str):
        self.name, self.waited_for = name, []

    def wait_stream(self, other: "FakeStream") -> None:
        self.waited_for.append(other.name)


class FakeCUDA:
    """torch.cuda's stream and graph API as the capture uses it, recording what happens."""

    def __init__(self):
        self.default = FakeStream("default")
        self.current = self.default
        self.capturing: "FakeGraph | None" = None
        self.pool = object()  # what graph_pool_handle() returns: an opaque handle
        self.events: list[tuple] = []  # ("model", stream name, capturing?) and ("capture", pool)
        self.side_streams: list[FakeStream] = []

    def install(self, monkeypatch) -> None:
        fake = self

        class CUDAGraph(FakeGraph):
            def __init__(self):
                super().__init__(fake)

        monkeypatch.setattr(torch.cuda, "Stream", self.new_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
        monkeypatch.setattr(torch.cuda, "graph", self.graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: fake.pool)

    def new_stream(self, device=None, **kwargs) -> FakeStream:
        self.side_streams.append(FakeStream("side"))
        return self.side_streams[-1]

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def graph(self, graph: "FakeGraph", pool=None, stream=None, **kwargs):
        assert self.capturing is None, "a capture started inside another capture"
        self.events.append(("capture", pool))
        self.capturing = graph
        try:
            yield
        finally:
            self.capturing = None


class FakeGraph:
    def __init__(self, cuda: FakeCUDA):
        self.cuda, self.recorded, self.replays = cuda, None, 0

    def replay(self) -> None:
        assert self.recorded is not None, "replay() of a graph that recorded nothing"
        model, args, kwargs, output = self.recorded
        with torch.inference_mode():  # the model's outputs are inference tensors
            output.copy_(model(*args, **kwargs))  # same inputs, same output memory
        self.replays += 1


class RecordingModel:
    """The runner's model: notes each call's stream and whether a capture is recording it."""

    def __init__(self, model, cuda: FakeCUDA):
        self.model, self.cuda = model, cuda

    def __call__(self, *args, **kwargs):
        output = self.model(*args, **kwargs)
        capturing = self.cuda.capturing
        self.cuda.events.append(("model", self.cuda.current.name, capturing is not None))
        if capturing is not None:
            assert capturing.recorded is None, "one graph recorded two model passes"
            capturing.recorded = (self.model, args, kwargs, output)
        return output


def graph_runner_on_fake_cuda(monkeypatch, family: str, **knobs):
    """(stage 8 runner told it is on CUDA, stage 4 runner, the fake CUDA)."""
    graph, eager = runners(engine_model(family), **knobs)
    cuda = FakeCUDA()
    cuda.install(monkeypatch)
    runner = graph.cuda_graph_runner
    runner.use_cuda_graph, runner.graph_pool = True, torch.cuda.graph_pool_handle()
    runner.model = RecordingModel(runner.model, cuda)
    return graph, eager, cuda


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_capture_warms_up_on_a_side_stream_then_records_one_pass_per_bucket(monkeypatch, tiny_models_root, family):
    graph, eager, cuda = graph_runner_on_fake_cuda(monkeypatch, str(tiny_models_root / family))
    runner = graph.cuda_graph_runner
    sizes = [5, 5, 4, 3, 3, 1]  # buckets 8, 8, 4, 4, 4, 1
    prompts = prompts_of(5)
    mine, theirs = start(graph, prompts), start(eager, prompts)
    run_pass(graph, mine), run_pass(eager, theirs)  # the prefill: eager on both
    for step, size in enumerate(sizes):
        events_before = len(cuda.events)
        _, expected = run_pass(eager, theirs[:size])
        _, got = run_pass(graph, mine[:size], tokens=expected.argmax(-1).tolist())
        assert graph.last_forward_path == "graph", f"decode {step} ({size} requests) took the {graph.last_forward_path!r} path"
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (
            f"decode {step}: replayed logits differ from the eager runner's by {(got - expected).abs().max().item():.3g}"
        )
        new = cuda.events[events_before:]
        first_use = step == 0 or runner.bucket_for(size, 1)[0] != runner.bucket_for(sizes[step - 1], 1)[0]
        if first_use:
            warmups = [e for e in new if e[0] == "model" and not e[2]]
            assert warmups == [("model", "side", False)] * cgr.NUM_WARMUP_RUNS, (
                f"decode {step}: a new bucket must run the model {cgr.NUM_WARMUP_RUNS} times on a side stream "
                f"(torch.cuda.Stream, with torch.cuda.stream(...)) before the capture; saw {new}"
            )
            captures = [i for i, e in enumerate(new) if e[0] == "capture"]
            assert len(captures) == 1 and captures[0] > max(i for i, e in enumerate(new) if e in warmups), (
                f"decode {step}: exactly one capture, after the warm-up runs; saw {new}"
            )
            assert new[captures[0]][1] is cuda.pool, "every capture must share the runner's graph_pool (pool=self.graph_pool)"
            assert new[captures[0] + 1][0] == "model" and new[captures[0] + 1][2], "the capture must record one model pass"
        else:
            assert new == [], f"decode {step}: a bucket already captured must only replay (no model call, no capture); saw {new}"
    buckets = {runner.bucket_for(s, max(r.device_len for r in mine[:s]))[0] for s in sizes}
    assert {bs for bs, _ in runner.graphs} == buckets, f"graphs captured for {sorted(runner.graphs)}, expected batch sizes {sorted(buckets)}"
    assert set(runner.output_buffers) == set(runner.graphs), "keep each graph's output logits in output_buffers, under its bucket"
    assert sum(g.replays for g in runner.graphs.values()) == len(sizes), "every decode must replay its bucket's graph once"


def test_capture_records_the_buckets_static_batch_and_waits_for_the_side_stream(monkeypatch, tiny_models_root):
    graph, _, cuda = graph_runner_on_fake_cuda(monkeypatch, str(tiny_models_root / "llama"))
    runner = graph.cuda_graph_runner
    reqs = start(graph, prompts_of(3))
    run_pass(graph, reqs)
    run_pass(graph, reqs)  # bucket 4: warm-up, capture, replay
    (bucket,) = runner.graphs
    model, args, kwargs, output = runner.graphs[bucket].recorded
    assert args[0] is runner.batches[bucket], "the graph must record a pass over the bucket's static batch (views of the buffers)"
    assert kwargs.get("return_all_logits") or (len(args) > 1 and args[1]), "record the logits of every row (return_all_logits=True)"
    assert runner.output_buffers[bucket] is output, "output_buffers must hold the very tensor the captured pass returned"
    assert output.shape[0] == bucket[0], f"the captured output has a row per bucket row ({bucket[0]}), got {tuple(output.shape)}"
    assert cuda.side_streams and all("default" in s.waited_for for s in cuda.side_streams), (
        "the side stream must wait for the default stream before the warm-up (side.wait_stream(current_stream()))"
    )
    assert "side" in cuda.default.waited_for, "the default stream must wait for the side stream after the warm-up"


def test_a_capture_that_failed_is_captured_again_not_replayed(monkeypatch, tiny_models_root):
    """A capture can fail (out of GPU memory, say). The decode that asked for it fails with it,
    but the bucket must not look ready afterwards: the same decode tried again captures afresh."""
    graph, eager, cuda = graph_runner_on_fake_cuda(monkeypatch, str(tiny_models_root / "llama"))
    runner = graph.cuda_graph_runner
    prompts = prompts_of(3)
    mine, theirs = start(graph, prompts), start(eager, prompts)
    run_pass(graph, mine), run_pass(eager, theirs)  # the prefill: eager on both
    recording = runner.model

    def fails_while_capturing(*args, **kwargs):
        if cuda.capturing is not None:
            raise RuntimeError("CUDA out of memory (planted by the test, during the capture)")
        return recording(*args, **kwargs)

    batch = prepare_forward(graph, mine)
    runner.model = fails_while_capturing
    with pytest.raises(RuntimeError):
        graph.forward(batch)
    runner.model = recording
    _, expected = run_pass(eager, theirs)
    try:
        got = graph.forward(batch)
    except KeyError as missing:
        pytest.fail(f"after a failed capture, bucket {missing} was taken as captured and replay found no graph: "
                    "register a bucket (self.batches) only once its capture has succeeded", pytrace=False)
    assert graph.last_forward_path == "graph", f"the decode tried again took the {graph.last_forward_path!r} path"
    (bucket,) = runner.graphs
    assert runner.graphs[bucket].replays == 1, "the decode tried again must capture the bucket and replay it once"
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (
        f"after the capture was retried the logits differ from the eager runner's by {(got - expected).abs().max().item():.3g}"
    )
