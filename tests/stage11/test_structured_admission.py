"""Stage 11 (graded): grammars compile in the background, and only then is a request admitted.

A request whose grammar is still compiling waits on the side while free and already-compiled
requests run to their end; once its grammar is ready it runs, and its output follows it. A grammar
that does not compile aborts its request with the library's reason; a bad combination of fields
is refused when the SamplingParams are built; one that compiles for longer than grammar_timeout
ends its request too, rather than leave it waiting forever."""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass, field

import pytest
import torch

from invariants import check_all
from s02_request_and_sampling.sampling_params import SamplingParams
from s11_structured_output.sampling_params import StructuredSamplingParams
from structured_helpers import REGEXES, SCHEMAS, assert_follows, constrained, engine_on


@pytest.fixture(scope="module")
def engine(tiny_models_root):
    return engine_on(tiny_models_root / "qwen3", pool_size=1024)


def run_until_idle(engine, max_steps: int = 2000) -> list:
    """Step until idle, the invariants checked after every step; returns every output."""
    outputs: list = []
    with torch.inference_mode():
        for step in range(max_steps):
            if not engine.has_work:
                return outputs
            outputs += engine.step()
            check_all(engine, f"after step {step + 1}")
    raise AssertionError(f"the engine still had work after {max_steps} steps")


@dataclass
class Hold:
    compiled_here: list = field(default_factory=list)  # keys compiled on the thread that steps the engine
    outlasted: threading.Event = field(default_factory=threading.Event)  # the hold ran to at_most_s


@contextlib.contextmanager
def compilation_held(engine, key: tuple[str, str], at_most_s: float):
    """The grammar backend's compilation of ``key`` waits until the block ends (or ``at_most_s``:
    then ``outlasted`` is set). A compilation on the thread that entered the block (the one that
    adds requests and steps the engine) does not wait: its key goes into ``compiled_here``."""
    backend = engine.scheduler.grammar_backend
    release, hold = threading.Event(), Hold()
    compile_ = backend.compile
    caller = threading.get_ident()

    def held_compile(k):
        if threading.get_ident() == caller:
            hold.compiled_here.append(k)
        elif k == key and not release.wait(at_most_s):
            hold.outlasted.set()
        return compile_(k)

    backend.compile = held_compile
    try:
        yield hold
    finally:
        release.set()
        backend.compile = compile_


def test_a_compiling_request_does_not_block_the_others(engine):
    with compilation_held(engine, ("regex", REGEXES[3]), at_most_s=30) as hold:
        slow = engine.add_request([72, 73], constrained("regex", REGEXES[3]))
        free = engine.add_request([74, 75], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
        fast = engine.add_request([76, 77], constrained("json", SCHEMAS["optional"]))
        assert not hold.compiled_here, (
            f"the grammars {hold.compiled_here} compiled on the thread that added the requests (the scheduler's own): "
            "the backend's get() starts a compilation on its pool and returns the Future at once, so that one slow "
            "grammar never blocks the scheduler"
        )
        with torch.inference_mode():
            for step in range(500):
                if free.finished and fast.finished:
                    break
                engine.step()
                check_all(engine, f"after step {step + 1}, one grammar still compiling")
        assert free.finished and fast.finished, (
            "while one request's grammar was compiling, the free request and one with another grammar should "
            f"have run to their end; free: {free}, other grammar: {fast}"
        )
        assert not slow.output_ids and not slow.finished and slow.req_pool_idx is None, (
            f"a request whose grammar is still compiling must not be admitted (it has no mask yet): {slow}"
        )
    run_until_idle(engine)
    assert_follows(
        slow.output_text, slow.finished_reason, "regex", REGEXES[3], "the request that waited for its grammar"
    )
    assert_follows(fast.output_text, fast.finished_reason, "json", SCHEMAS["optional"], "the other constrained request")
    check_all(engine, "after the slow compilation")


def test_a_grammar_that_compiles_too_long_aborts_its_request(tiny_models_root):
    """A compilation that outlasts grammar_timeout ends its request (abort, with the reason) instead
    of keeping it, and its client, waiting forever; the requests beside it run as usual."""
    engine = engine_on(tiny_models_root / "qwen3", pool_size=1024, grammar_timeout=0.3)
    # held far past the timeout: a missed timeout shows as a request that ran on its late grammar
    with compilation_held(engine, ("regex", REGEXES[2]), at_most_s=30) as hold:
        stuck = engine.add_request([72, 73], constrained("regex", REGEXES[2]))
        free = engine.add_request([74, 75], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
        outputs = run_until_idle(engine, max_steps=20000)  # a step without work waits a little for a compilation
        stalled = hold.outlasted.is_set()  # read before the block lets the compilation go
    assert stuck.finished_reason is not None and stuck.finished_reason.type == "abort" and not stuck.output_ids, (
        f"a grammar still compiling after grammar_timeout=0.3 s should abort its request, with no tokens: {stuck}"
    )
    assert stuck.grammar_error and re.search("longer than|took|timed? ?out|timeout", stuck.grammar_error), (
        f"its grammar_error should say the grammar took longer than grammar_timeout: {stuck.grammar_error!r}"
    )
    assert any(out.rid == stuck.rid and out.finish_reason and out.finish_reason.type == "abort" for out in outputs), (
        "the timed-out request's end should be streamed like any other's (a TokenOutput with finish reason abort: "
        "built after req.abort(), which sets it)"
    )
    assert not stalled, (
        "the engine went idle only once the held compilation was let go (after 30 s): the scheduler waited for "
        "a compilation still running. future.exception() and future.result() wait for it: ask them only of a "
        "future that is done (a timed-out one is not)"
    )
    assert len(free.output_ids) == 3, f"the free request beside it should run to its end: {free}"
    check_all(engine, "after a grammar timed out")


def test_a_grammar_ready_in_time_is_not_timed_out_by_a_late_poll(tiny_models_root):
    """grammar_timeout bounds the compilation, not the wait for the next poll: a grammar that is ready
    admits its request however long after its arrival the loop gets to it (a long step before)."""
    engine = engine_on(tiny_models_root / "qwen3", pool_size=1024, grammar_timeout=5.0)
    req = engine.add_request([72, 73], constrained("regex", REGEXES[0]))
    [(_, compiling)] = engine.scheduler.grammar_queue
    compiling.result(timeout=30)
    clock = engine.scheduler.clock
    engine.scheduler.clock = lambda: clock() + 60  # the loop polls a minute after the request came
    run_until_idle(engine)
    assert req.grammar_error is None and req.finished_reason is not None and req.finished_reason.type == "stop", (
        f"a request whose grammar compiled in time was ended ({req.finished_reason}, {req.grammar_error!r}): it "
        "times out only while its grammar is still compiling (not future.done()), whatever time the poll comes"
    )
    assert_follows(req.output_text, req.finished_reason, "regex", REGEXES[0], "the request polled late")


def test_a_request_whose_grammar_is_ready_joins_the_end_of_the_line(tiny_models_root):
    """A request takes its place in line when its grammar is ready (waiting.append): behind the
    requests already waiting then, however early it arrived. One table row, so they go one by one."""
    engine = engine_on(tiny_models_root / "qwen3", pool_size=1024, max_running_requests=1, schedule_policy="fcfs")
    free = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    with compilation_held(engine, ("regex", REGEXES[1]), at_most_s=30):
        late = engine.add_request([72, 73], constrained("regex", REGEXES[1]))
        first = engine.add_request([74, 75], free)
        second = engine.add_request([76, 77], free)
        with torch.inference_mode():
            engine.step()  # first runs (the only row), second waits, late's grammar compiles
    [(_, compiling)] = engine.scheduler.grammar_queue
    compiling.result(timeout=30)  # ready before first ends, so late is in line while second waits
    run_until_idle(engine)
    order = sorted(
        (req.time_stats.scheduled[0], name) for name, req in [("first", first), ("second", second), ("late", late)]
    )
    assert [name for _, name in order] == ["first", "second", "late"], (
        f"admitted in the order {[name for _, name in order]}: a request whose grammar becomes ready joins the END "
        "of the waiting queue (waiting.append), behind those already waiting"
    )


@pytest.mark.parametrize(
    "kind,spec,why",
    [("regex", "[0-9", "unclosed character class"), ("json", {"type": "integer", "minimum": "zero"}, "minimum")],
    ids=["regex", "schema"],
)
def test_a_grammar_that_does_not_compile_aborts_its_request(engine, kind, spec, why):
    bad = engine.add_request([70, 71], constrained(kind, spec))
    good = engine.add_request([70, 72], constrained("regex", REGEXES[0]))
    outputs = run_until_idle(engine)
    assert bad.finished_reason is not None and bad.finished_reason.type == "abort" and not bad.output_ids, (
        f"a {kind} that does not compile should abort its request with no tokens: {bad}"
    )
    assert bad.grammar_error and why in bad.grammar_error, (
        f"the aborted request's grammar_error should carry the library's reason (mentioning {why!r}): "
        f"{bad.grammar_error!r}"
    )
    assert any(out.rid == bad.rid and out.finish_reason and out.finish_reason.type == "abort" for out in outputs), (
        "the aborted request's end should be streamed like any other's (a TokenOutput with finish reason abort: "
        "built after req.abort(), which sets it)"
    )
    assert bad.time_stats.finished is not None, (
        f"the aborted request's time_stats.finished is not set: its latency (and the server's metrics) are "
        f"measured to the moment it ended: {bad.time_stats}"
    )
    assert_follows(good.output_text, good.finished_reason, "regex", REGEXES[0], "the request beside it")
    check_all(engine, "after a grammar failed")
    compiled = engine.scheduler.grammar_backend.compilations
    again = engine.add_request([70, 73], constrained(kind, spec))
    run_until_idle(engine)
    assert again.grammar_error == bad.grammar_error and engine.scheduler.grammar_backend.compilations == compiled, (
        f"the same {kind} sent again was compiled again ({engine.scheduler.grammar_backend.compilations - compiled} "
        "time(s)): a failed compilation stays cached too, since the same grammar fails the same way "
        f"(grammar_error {again.grammar_error!r})"
    )


@pytest.mark.parametrize(
    "fields,message,why",
    [
        (dict(json_schema={"type": "object"}, regex="a"), "cannot both", "a request follows one grammar"),
        (dict(json_schema={}, regex="a"), "cannot both", "{} is a schema too (any JSON): test for None, not truth"),
        (dict(json_schema="{not json"), "not valid JSON", "canonical_schema reads a schema sent as text"),
        (dict(json_schema=[1, 2]), "JSON object", "a schema is a JSON object"),
        (dict(regex=""), "non-empty", "a regex is a non-empty str"),
        (dict(regex=123), "string", "a regex is a non-empty str"),
        (dict(regex="a+", ignore_eos=True), "ignore_eos", "any grammar, a regex too, ends with EOS"),
        (
            dict(json_schema={"type": "object"}, ignore_eos=True),
            "ignore_eos",
            "any grammar, a schema too, ends with EOS",
        ),
        (
            dict(json_schema={"type": "object"}, min_new_tokens=4),
            "min_new_tokens",
            "a complete grammar allows only EOS",
        ),
        (dict(regex="a+", min_new_tokens=4), "min_new_tokens", "a complete grammar, a regex's too, allows only EOS"),
    ],
)
def test_bad_grammar_fields_are_refused_at_once(fields, message, why):
    try:
        StructuredSamplingParams(**fields)
    except ValueError as error:
        assert message in str(error), f"StructuredSamplingParams({fields}): the error should say {message!r}: {error}"
    else:
        pytest.fail(
            f"StructuredSamplingParams({fields}) should be refused with a ValueError saying {message!r} ({why})"
        )


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_a_grammar_the_library_gives_up_on_ends_alone(tiny_models_root, disable_overlap):
    """a{1000000} compiles, but matching its first token passes one of llguidance's limits: that
    request ends (abort, with the library's reason), and the requests in its batch go on."""
    engine = engine_on(tiny_models_root / "qwen3", pool_size=1024, disable_overlap=disable_overlap)
    free = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    [expected] = engine.generate([[70, 73]], free)
    hopeless = engine.add_request([70, 71], constrained("regex", "a{1000000}"))
    good = engine.add_request([70, 72], constrained("regex", REGEXES[0]))
    plain = engine.add_request([70, 73], free)
    outputs = run_until_idle(engine)
    assert hopeless.finished_reason is not None and hopeless.finished_reason.type == "abort", (
        f"a request whose grammar the library gave up on should end with finish reason abort: {hopeless}"
    )
    assert hopeless.grammar_error and "gave up" in hopeless.grammar_error, (
        f"its grammar_error should say the library gave up, and why: {hopeless.grammar_error!r}"
    )
    assert any(out.rid == hopeless.rid and out.finish_reason and out.finish_reason.type == "abort" for out in outputs)
    assert_follows(good.output_text, good.finished_reason, "regex", REGEXES[0], "a constrained request beside it")
    assert plain.output_ids == expected.output_ids, "a free request beside it should run as if alone"
    check_all(engine, "after the library gave up on a grammar")
    [offline] = engine.generate([[70, 71]], constrained("regex", "a{1000000}"))
    assert offline.finish_reason.type == "abort" and offline.error and "gave up" in offline.error, (
        f"generate() should hand the reason back in the output's error: {offline}"
    )
