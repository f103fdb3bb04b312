"""Stage 12 (graded): the stage 9 server with ``--tp-size 2`` streams one device's tokens through
the official ``openai`` client, and stopping it leaves no rank behind."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "stage09"))

from tp_helpers import KNOBS, children_of  # noqa: E402

from reference import engine_model, engine_tokenizer  # noqa: E402
from s10_overlap_scheduling.engine import OverlapEngine  # noqa: E402
from serving_helpers import Server, greedy, offline_outputs, stream_concurrently, wait_gone  # noqa: E402


def test_the_server_streams_with_two_ranks_and_stops_them(tiny_models_root, tmp_path_factory):
    path = tiny_models_root / "llama"
    prompts, limits = ["Hello", "The quick brown fox", "a\nb\n\nc"], [8, 10, 6]
    tokenizer = engine_tokenizer(str(path))
    engine = OverlapEngine(engine_model(str(path)), tokenizer, **KNOBS)
    expected = offline_outputs(engine, [tokenizer.encode(p) for p in prompts], [greedy(n) for n in limits])
    server = Server(
        path,
        ["--tp-size", "2", "--pool-size", "1024", "--max-running-requests", "16"],
        tmp_path_factory.mktemp("s12-server"),
    )
    try:
        ranks = children_of(server.pids()["scheduler"])
        assert ranks, "the scheduler process (rank 0) should have started rank 1 as its child"
        requests_ = [dict(model=path.name, prompt=p, max_tokens=n, temperature=0) for p, n in zip(prompts, limits)]
        answers = stream_concurrently(server, "completions", requests_)
        for (text, finish), ref, prompt in zip(answers, expected, prompts):
            assert (text, finish) == (ref.text, ref.finish_reason.type), (
                f"--tp-size 2, prompt {prompt!r}: streamed {text!r} ({finish}), one device "
                f"{ref.text!r} ({ref.finish_reason.type})"
            )
    finally:
        server.stop()
    left = wait_gone(ranks, timeout=15)
    assert not left, f"the server stopped, but its tensor-parallel ranks {left} still run"
