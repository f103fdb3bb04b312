"""Stage 8 (graded): the capture itself, on any machine, against a stand-in for torch.cuda.

A CPU cannot record a CUDA graph, but the capture's protocol can be checked anywhere. These tests
swap torch.cuda's stream and graph API for stand-ins that behave as CUDA does where it matters:

- work queued inside ``with torch.cuda.graph(g, pool=...)`` runs once and is recorded by ``g``;
- ``g.replay()`` runs the recorded pass again, on the same input tensors, and writes its result
  into the same output tensor the capture returned (a graph has fixed addresses, not return values).
  Unlike CUDA it re-runs the pass's Python too; that the pass holds nothing but device work is
  test_graph_capturable.py's concern.

Then the runner is told it is on CUDA and captures, as an engine does when it starts: every
bucket, largest first, each warmed up ``NUM_WARMUP_RUNS`` times on a side stream before one pass
is recorded into the one shared memory pool; it keeps each graph and its output, and answers
every decode by replaying its bucket's graph, with the same logits as stage 4's eager runner. A
capture that fails stops the start with a message naming the bucket and how to run without
graphs. ``make gpu-check`` checks the same on a real GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

from graph_helpers import prompts_of, run_pass, runners, start, static_batch_problems
from reference import engine_model
from s08_cuda_graph import cuda_graph_runner as cgr


class FakeStream:
    def __init__(self, name: str, timeline: list[tuple]):
        self.name, self.timeline = name, timeline
        self.waited_for: list[str] = []

    def wait_stream(self, other: "FakeStream") -> None:
        self.waited_for.append(other.name)
        self.timeline.append(("wait", self.name, other.name))


class PoolHandle:
    """What graph_pool_handle() returns: an opaque handle (named in messages), a new one, so a
    new pool, at every call."""

    def __init__(self, number: int):
        self.number = number

    def __repr__(self) -> str:
        return f"<graph_pool {self.number}>"


class FakeCUDA:
    """torch.cuda's stream and graph API as the capture uses it, recording what happens."""

    def __init__(self):
        # Everything in order: the events below and each wait_stream ("wait", who waits, for whom).
        self.timeline: list[tuple] = []
        self.default = FakeStream("default", self.timeline)
        self.current = self.default
        self.capturing: "FakeGraph | None" = None
        self.pools: list[PoolHandle] = []  # every handle graph_pool_handle() gave
        self.pool: PoolHandle | None = None  # the runner's own, set once it has one
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
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", self.new_pool)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def new_pool(self) -> PoolHandle:
        self.pools.append(PoolHandle(len(self.pools) + 1))
        return self.pools[-1]

    def new_stream(self, device=None, **kwargs) -> FakeStream:
        self.side_streams.append(FakeStream("side", self.timeline))
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
        self.timeline.append(("capture", pool))
        self.capturing = graph
        try:
            yield
        finally:
            self.capturing = None


class FakeGraph:
    def __init__(self, cuda: FakeCUDA):
        self.cuda, self.recorded, self.replays = cuda, None, 0
        self.metadata = None  # the decode metadata's tensors the recorded pass read

    def replay(self) -> None:
        assert self.recorded is not None, "replay() of a graph that recorded nothing"
        model, args, kwargs, output = self.recorded
        # As on CUDA, the replay reads the very metadata tensors its capture read, whatever the
        # backend holds now: a refill of other tensors (another bucket's views) goes unseen.
        args[0].attn_backend.decode_metadata = self.metadata
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
        self.cuda.timeline.append(self.cuda.events[-1])
        if capturing is not None:
            assert capturing.recorded is None, "one graph recorded two model passes"
            capturing.recorded = (self.model, args, kwargs, output)
            capturing.metadata = replace(args[0].attn_backend.decode_metadata)  # its tensors, as they are now
        return output


def graph_runner_on_fake_cuda(monkeypatch, family: str, **knobs):
    """(stage 8 runner told it is on CUDA, stage 4 runner, the fake CUDA); nothing captured yet:
    ``runner.cuda_graph_runner.capture()`` does what an engine's start does."""
    graph, eager = runners(engine_model(family), **knobs)
    cuda = FakeCUDA()
    cuda.install(monkeypatch)
    runner = graph.cuda_graph_runner
    runner.use_cuda_graph, runner.graph_pool = True, torch.cuda.graph_pool_handle()
    cuda.pool = runner.graph_pool
    runner.model = RecordingModel(runner.model, cuda)
    return graph, eager, cuda


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_capture_at_start_warms_up_then_records_every_bucket_largest_first(monkeypatch, tiny_models_root, family):
    graph, eager, cuda = graph_runner_on_fake_cuda(monkeypatch, str(tiny_models_root / family))
    runner = graph.cuda_graph_runner
    runner.capture()
    expected = sorted(((bs, kv) for bs in runner.capture_bs for kv in runner.capture_kv_lens), reverse=True)
    assert list(runner.graphs) == expected, (
        f"capture() must record a graph for every bucket, largest first (so smaller graphs reuse the largest one's "
        f"memory): expected {expected}, got {list(runner.graphs)}"
    )
    assert set(runner.output_buffers) == set(runner.graphs), (
        "keep each graph's output logits in output_buffers, under its bucket"
    )
    each = cgr.NUM_WARMUP_RUNS + 2  # the warm-up runs, the capture, the pass it records
    per_bucket = [cuda.events[i : i + each] for i in range(0, len(cuda.events), each)]
    for bucket, events in zip(expected, per_bucket):
        warmups, capture, recorded = events[: cgr.NUM_WARMUP_RUNS], events[-2], events[-1]
        assert warmups == [("model", "side", False)] * cgr.NUM_WARMUP_RUNS, (
            f"bucket {bucket}: run the model {cgr.NUM_WARMUP_RUNS} times on a side stream (torch.cuda.Stream, with "
            f"torch.cuda.stream(...)) before the capture; saw {events}"
        )
        assert capture == ("capture", cuda.pool), (
            f"bucket {bucket}: then one capture into the shared graph_pool (pool=self.graph_pool), the one pool the "
            "runner made at start: a new torch.cuda.graph_pool_handle() per capture is a new pool per graph, memory "
            f"the graphs cannot share; saw {events}"
        )
        assert recorded[0] == "model" and recorded[2], (
            f"bucket {bucket}: the capture must record one model pass; saw {events}"
        )
    assert len(cuda.events) == each * len(expected), (
        f"each bucket's capture is {each} events ({cgr.NUM_WARMUP_RUNS} warm-up runs on the side stream, the capture, "
        f"the pass it records): {len(expected)} buckets should give {each * len(expected)}, got {len(cuda.events)}"
    )

    for bucket, graph_of_bucket in runner.graphs.items():
        assert runner.output_buffers[bucket] is graph_of_bucket.recorded[3], (
            f"bucket {bucket}: output_buffers must hold the very tensor the captured pass returned (a replay writes "
            "that tensor; a copy of it would keep the capture's logits forever)"
        )

    cuda.events.clear()
    sizes = [5, 5, 4, 3, 3, 1]  # buckets 8, 8, 4, 4, 4, 1
    prompts = prompts_of(5)
    mine, theirs = start(graph, prompts), start(eager, prompts)
    run_pass(graph, mine), run_pass(eager, theirs)  # the prefill: eager on both
    for step, size in enumerate(sizes):
        _, expected_logits = run_pass(eager, theirs[:size])
        batch, got = run_pass(graph, mine[:size], tokens=expected_logits.argmax(-1).tolist())
        assert graph.last_forward_path == "graph", (
            f"decode {step} ({size} requests) took the {graph.last_forward_path!r} path"
        )
        problems = static_batch_problems(runner, batch)
        assert not problems, f"decode {step} ({size} requests), after replay_prepare:\n  " + "\n  ".join(problems)
        assert torch.allclose(got, expected_logits, rtol=1e-4, atol=1e-4), (
            f"decode {step}: replayed logits differ from the eager runner's by "
            f"{(got - expected_logits).abs().max().item():.3g}, though the static buffers and the bucket's metadata "
            "hold the batch: the decode pass itself computes otherwise (check attend_decode: one masked attention "
            "over each row's gathered keys, query head h reading KV head h // G)"
        )
    assert [e for e in cuda.events if e[0] == "capture" or e[1] == "side"] == [], (
        f"after the start, decodes must only replay (no warm-up, no capture): saw {cuda.events[:6]}"
    )
    assert sum(g.replays for g in runner.graphs.values()) == len(sizes), (
        "every decode must replay its bucket's graph once"
    )


def test_capture_records_the_buckets_static_batch_and_waits_for_the_side_stream(monkeypatch, tiny_models_root):
    graph, _, cuda = graph_runner_on_fake_cuda(monkeypatch, str(tiny_models_root / "llama"))
    runner = graph.cuda_graph_runner
    runner.capture()
    for bucket in [(4, 64), (8, 256)]:
        model, args, kwargs, output = runner.graphs[bucket].recorded
        assert args[0] is runner.batches[bucket], (
            f"bucket {bucket}: the graph must record a pass over the bucket's static batch (views of the buffers)"
        )
        assert kwargs.get("return_all_logits") or (len(args) > 1 and args[1]), (
            "record the logits of every row (return_all_logits=True)"
        )
        assert runner.output_buffers[bucket] is output, (
            "output_buffers must hold the very tensor the captured pass returned"
        )
        assert output.shape[0] == bucket[0], (
            f"the captured output has a row per bucket row ({bucket[0]}), got {tuple(output.shape)}"
        )
    assert cuda.side_streams and all("default" in s.waited_for for s in cuda.side_streams), (
        "the side stream must wait for the default stream before the warm-up (side.wait_stream(current_stream()))"
    )
    assert "side" in cuda.default.waited_for, "the default stream must wait for the side stream after the warm-up"


def test_the_streams_wait_for_each_other_around_every_bucket_s_warm_ups(monkeypatch, tiny_models_root):
    """The order matters, not only that both waits happen: a wait orders the work queued BEFORE it
    on the stream waited for against the work queued AFTER it on the waiting stream."""
    graph, _, cuda = graph_runner_on_fake_cuda(monkeypatch, str(tiny_models_root / "llama"))
    runner = graph.cuda_graph_runner
    runner.capture()
    segments, segment = [], []  # the timeline cut after each recorded pass: one segment per bucket
    for event in cuda.timeline:
        segment.append(event)
        if event[0] == "model" and event[2]:
            segments.append(segment)
            segment = []
    assert len(segments) == len(runner.graphs), f"one recorded pass per bucket; the timeline: {cuda.timeline[:12]}"
    for bucket, events in zip(runner.graphs, segments):
        warmups = [i for i, event in enumerate(events) if event == ("model", "side", False)]
        assert warmups, f"bucket {bucket}: no warm-up on a side stream before the capture; saw {events}"
        side_waits = [i for i, event in enumerate(events) if event == ("wait", "side", "default")]
        assert side_waits and side_waits[0] < warmups[0], (
            f"bucket {bucket}: the side stream must wait for the default stream (side.wait_stream(current)) BEFORE its "
            "first warm-up: the static buffers and the metadata were filled on the default stream, and a warm-up "
            f"queued before the wait may read them half-written; saw {events}"
        )
        capture = next(i for i, event in enumerate(events) if event[0] == "capture")
        default_waits = [i for i, event in enumerate(events) if event == ("wait", "default", "side")]
        assert any(warmups[-1] < i < capture for i in default_waits), (
            f"bucket {bucket}: the default stream must wait for the side stream (current.wait_stream(side)) AFTER the "
            "last warm-up and before the capture: a wait orders only the work already queued on the side stream, so "
            f"one before the warm-ups lets the capture and the next bucket's buffers race them; saw {events}"
        )


def test_a_capture_that_fails_stops_the_start_naming_the_bucket(monkeypatch, tiny_models_root):
    """A capture can fail (out of GPU memory, say). It must fail when the engine starts, not in
    the middle of serving, and say which bucket failed and how to run without graphs."""
    graph, _, cuda = graph_runner_on_fake_cuda(monkeypatch, str(tiny_models_root / "llama"))
    runner = graph.cuda_graph_runner
    recording = runner.model

    def fails_while_capturing_bucket_4_128(batch, **kwargs):
        kv_len = runner.attn_backend.decode_metadata.kv_indices.shape[1]  # the bucket being set up
        if cuda.capturing is not None and (batch.num_reqs, kv_len) == (4, 128):
            raise RuntimeError("CUDA out of memory (planted by the test, during the capture)")
        return recording(batch, **kwargs)

    runner.model = fails_while_capturing_bucket_4_128
    with pytest.raises(RuntimeError) as failure:
        runner.capture()
    message = str(failure.value)
    assert "bs=4" in message and "kv_len=128" in message, (
        f"the error must name the bucket that failed (bs=4, kv_len=128): {message}"
    )
    assert "--disable-cuda-graph" in message, (
        f"the error must say how to run without graphs (--disable-cuda-graph): {message}"
    )
    assert "out of memory" in message, f"the error must carry the capture's own error: {message}"
