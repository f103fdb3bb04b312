"""Stage 10 (graded): the stage 9 server runs on this engine.

The scheduler process serves stage 10's engine by default (stage 8's with ``--disable-overlap``,
which stage 9's own tests pass), and the official ``openai`` client streams from a server with overlap on: concurrent
requests, some ending on a stop string (so they finish while already scheduled for one more
step), each get exactly the text stage 8's engine produces offline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "stage09"))

from overlap_helpers import engine_on, step_until_idle  # noqa: E402
from reference import engine_tokenizer  # noqa: E402
from s08_cuda_graph.engine import CudaGraphEngine  # noqa: E402
from s09_zmq_serving import scheduler_process  # noqa: E402
from s09_zmq_serving.server_args import add_cli_args, from_cli_args  # noqa: E402
from s10_overlap_scheduling.engine import OverlapEngine, overlap_by_default  # noqa: E402
from serving_helpers import Server, greedy, offline_outputs, stream_concurrently  # noqa: E402


def test_the_server_runs_the_stage_10_engine_unless_overlap_is_disabled(tiny_models_root):
    path = tiny_models_root / "llama"
    for flags, overlap in (([], None), (["--enable-overlap"], True), (["--disable-overlap"], False)):
        parser = argparse.ArgumentParser()
        add_cli_args(parser)
        args = from_cli_args(parser.parse_args(["--model", str(path), "--pool-size", "256", *flags]))
        engine = scheduler_process.build_engine(str(path), args.engine_knobs)
        served = type(engine).__name__
        if overlap is not False:
            expected = (
                overlap if overlap is not None else overlap_by_default(engine.model.device, torch.get_num_threads())[0]
            )
            assert isinstance(engine, OverlapEngine) and engine.scheduler.enable_overlap == expected, (
                f"server flags {flags}: the server should run stage 10's OverlapEngine with overlap "
                f"{'on' if expected else 'off'}, runs {served}"
                + (
                    f" with overlap {'on' if engine.scheduler.enable_overlap else 'off'}"
                    if isinstance(engine, OverlapEngine)
                    else ""
                )
            )
        else:  # stage 8's engine: what stage 9's tests serve, with nothing of stage 10 needed
            assert type(engine) is CudaGraphEngine, (
                f"server flags {flags}: the server should run stage 8's CudaGraphEngine, runs {served}"
            )
        engine.add_request([72, 105], greedy(3, ignore_eos=True))
        outputs = step_until_idle(engine, f"server flags {flags}")
        assert [len(out.new_token_ids) for out in outputs] == [1, 1, 1], (
            f"server flags {flags}: one token per output: {outputs}"
        )


@pytest.fixture(scope="module")
def overlap_server(tiny_models_root, tmp_path_factory):
    server = Server(
        tiny_models_root / "llama",
        ["--pool-size", "2048", "--max-running-requests", "16", "--enable-overlap"],
        tmp_path_factory.mktemp("s10-server"),
    )
    yield server
    server.stop()


def test_the_openai_client_streams_from_the_overlapped_engine(overlap_server, tiny_models_root):
    path = tiny_models_root / "llama"
    tokenizer = engine_tokenizer(str(path))
    prompts = ["Hello", "The quick brown fox jumps", "a\nb\n\nc", "abcabc", "héllo wörld", "1 2 3 4"] * 2
    limits = [12, 9, 16, 7, 10, 14] * 2
    # the first half ends on a stop string taken from its own greedy text, so it stops before its limit
    reference = CudaGraphEngine(engine_on(path).model, tokenizer, pool_size=2048)
    plain = offline_outputs(reference, [tokenizer.encode(p) for p in prompts], [greedy(n) for n in limits])
    stops = [(out.text[3:5] if i < 6 and len(out.text) > 6 else None) for i, out in enumerate(plain)]
    params = [greedy(n, stop=[s] if s else None) for n, s in zip(limits, stops)]
    expected = offline_outputs(reference, [tokenizer.encode(p) for p in prompts], params)
    assert any(out.finish_reason.type == "stop" for out in expected), "test set-up: no request ends on its stop string"
    requests_ = [
        dict(model=path.name, prompt=p, max_tokens=n, temperature=0, **({"stop": [s]} if s else {}))
        for p, n, s in zip(prompts, limits, stops)
    ]
    answers = stream_concurrently(overlap_server, "completions", requests_)
    for i, ((text, finish), ref) in enumerate(zip(answers, expected)):
        assert (text, finish) == (ref.text, ref.finish_reason.type), (
            f"client {i} (prompt {prompts[i]!r}, stop {stops[i]!r}): the overlapped server streamed {text!r} "
            f"({finish}); stage 8's engine gives {ref.text!r} ({ref.finish_reason.type})"
        )
    state = overlap_server.debug_state()
    assert state["invariants"] == "ok", f"after the streams the scheduler's checks fail: {state['invariants']}"
