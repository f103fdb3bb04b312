"""Stage 12 (graded): the stage 9 server with ``--tp-size 2`` streams one device's tokens through
the official ``openai`` client, and stopping it leaves no rank behind; a rank that dies stops the
server with the reason (no step can run without it), rather than leaving it up to fail every request."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "stage09"))

from reference import engine_model, engine_tokenizer  # noqa: E402
from s10_overlap_scheduling.engine import OverlapEngine  # noqa: E402
from serving_helpers import Server, greedy, offline_outputs, stream_concurrently, wait_gone  # noqa: E402
from tp_helpers import KNOBS, children_of  # noqa: E402

# Each test starts a server with its ranks (half a minute on a busy 2-core machine): the stuck
# watch says "still running" only after that, not while a correct server is still starting.
pytestmark = pytest.mark.takes(90)


# --disable-overlap turns only the overlap off: the ranks still run stage 11's engine, grammars and all.
@pytest.mark.parametrize("overlap_flags", [[], ["--disable-overlap"]], ids=["default", "disable-overlap"])
def test_the_server_streams_with_two_ranks_and_stops_them(tiny_models_root, tmp_path_factory, overlap_flags):
    path = tiny_models_root / "llama"
    prompts, limits = ["Hello", "The quick brown fox", "a\nb\n\nc"], [8, 10, 6]
    tokenizer = engine_tokenizer(str(path))
    engine = OverlapEngine(engine_model(str(path)), tokenizer, **KNOBS)
    expected = offline_outputs(engine, [tokenizer.encode(p) for p in prompts], [greedy(n) for n in limits])
    server = Server(
        path,
        ["--tp-size", "2", "--pool-size", "1024", "--max-running-requests", "16", *overlap_flags],
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
        pattern = "(yes|no), [0-9]{2}"
        constrained = dict(model=path.name, prompt="Answer:", max_tokens=16, temperature=0)
        constrained["extra_body"] = {"regex": pattern}
        [(text, finish)] = stream_concurrently(server, "completions", [constrained])
        assert re.fullmatch(pattern, text) and finish == "stop", (
            f"--tp-size 2 {' '.join(overlap_flags)}: a request with regex {pattern!r} streamed {text!r} ({finish}); "
            "the ranks run stage 11's engine, so it must match the regex and stop there"
        )
    finally:
        server.stop()
    left = wait_gone(ranks, timeout=15)
    assert not left, f"the server stopped, but its tensor-parallel ranks {left} still run"


def test_a_dead_rank_stops_the_server_with_the_reason(tiny_models_root, tmp_path_factory):
    server = Server(
        tiny_models_root / "llama", ["--tp-size", "2", "--pool-size", "1024"], tmp_path_factory.mktemp("s12-dead-rank")
    )
    try:
        pids = server.pids()
        [rank_1] = children_of(pids["scheduler"])
        os.kill(rank_1, signal.SIGKILL)
        try:
            code = server.process.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(
                "30 s after rank 1 was killed the server still runs: a tensor-parallel group that lost a rank can run "
                "no step again, so the scheduler must stop (engine.fatal_error()) and the server with it, saying why; "
                f"/health answered {server.health().status_code}",
                pytrace=False,
            )
    finally:
        server.stop()
    assert code != 0, f"the server stopped with exit code {code} after losing a rank: a failure must not exit 0"
    log = server.log_text()
    assert f"the tensor-parallel group has stopped: rank 1 (pid {rank_1})" in log, (
        f"the server's log should say which rank was lost and that the group stopped:\n{server.why()}"
    )
    left = wait_gone(pids.values(), timeout=15)
    assert not left, f"the server stopped after losing a rank, but its processes {left} still run"
