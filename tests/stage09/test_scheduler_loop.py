"""Stage 9 (graded): the scheduler process's loop, without a server.

``SchedulerProcess.event_loop`` runs here against stand-ins that write down what it does: a socket
that hands out scripted messages and an engine that has work for a given number of steps. The
loop must wait on its socket only when the engine is idle (with requests running it only drains
what has arrived, so a step never waits for a message), process every message before the step
(a request that arrived joins this step; an abort frees its slots before it), and step the engine
only when it has work. A wrong ``block`` still serves every request correctly, which is why the
served tests cannot catch it: waiting while requests run adds up to IDLE_POLL_MS to every token,
and never waiting spins a core at 100% while the server is idle."""

from __future__ import annotations

from typing import Any

import pytest

from s02_request_and_sampling.sampling_params import SamplingParams
from s09_zmq_serving.io_struct import TokenizedGenerateReqInput
from s09_zmq_serving.scheduler_process import SchedulerProcess
from s09_zmq_serving.worker_loop import IDLE_POLL_MS


class LoopEnded(BaseException):
    """Raised by the stand-in socket when its script is over: the only way out of the loop (a
    BaseException, so that a loop that catches Exception still ends here)."""


class ScriptedEngine:
    """has_work while ``steps_left`` > 0; each step uses one."""

    def __init__(self):
        self.steps_left = 0

    @property
    def has_work(self) -> bool:
        return self.steps_left > 0

    def step(self):
        raise AssertionError(
            "the loop called engine.step() itself: call self.run_batch(), which steps the engine and turns a step "
            "that raises into errors for its requests instead of a dead loop"
        )


class ScriptedScheduler(SchedulerProcess):
    """A SchedulerProcess whose socket, message handling and engine step are stand-ins. Each
    recv_requests call returns the next list of ``script`` (a message "req:N" brings N steps of
    work; "abort" ends all of it) and records whether it would have blocked; the loop ends when
    the script does. Only ``event_loop`` is the real one."""

    engine: Any

    def __init__(self, script: list[list[str]]):  # no sockets, no engine: nothing of the base's __init__
        self.engine = ScriptedEngine()
        self.log: list[tuple] = []
        self.turns = iter(script)
        self.fail_with: Exception | None = None  # what run_batch raises, if anything

    def recv_requests(self, block: bool) -> list[str]:
        self.log.append(("recv", block, self.engine.has_work))
        try:
            return next(self.turns)
        except StopIteration:
            raise LoopEnded from None

    def process_input_request(self, message: str) -> None:
        self.log.append(("process", message))
        if message == "abort":
            self.engine.steps_left = 0
        else:
            self.engine.steps_left += int(message.split(":")[1])

    def run_batch(self) -> list[str]:
        if self.fail_with is not None:
            raise self.fail_with
        if not self.engine.has_work:
            raise AssertionError(
                "the loop ran a batch (run_batch) while the engine had no work: step only when engine.has_work"
            )
        self.engine.steps_left -= 1
        self.log.append(("run",))
        return [f"outputs of step {self.log.count(('run',))}"]

    def send_outputs(self, outputs: list[str]) -> None:
        self.log.append(("send", outputs))


def run_loop(script: list[list[str]]) -> list[tuple]:
    scheduler = ScriptedScheduler(script)
    with pytest.raises(LoopEnded):
        scheduler.event_loop()
    return scheduler.log


def check_blocking(log: list[tuple]) -> None:
    """Every recv blocked exactly when the engine was idle, with a message saying what each
    mistake costs."""
    for i, event in enumerate(log):
        if event[0] != "recv":
            continue
        _, block, busy = event
        if busy and block:
            raise AssertionError(
                f"turn {i}: the loop called recv_requests(block=True) while the engine had work: every step "
                f"would first wait up to IDLE_POLL_MS ({IDLE_POLL_MS} ms) for a message, so every token of every "
                "running request would be that much slower. Block only when idle: block=not self.engine.has_work"
            )
        if not busy and not block:
            raise AssertionError(
                f"turn {i}: the loop called recv_requests(block=False) while the engine was idle: an idle server "
                "would spin round this loop, one core at 100%, instead of sleeping in recv until a message "
                "comes. Block only when idle: block=not self.engine.has_work"
            )


def test_the_loop_blocks_only_when_idle_and_steps_only_with_work():
    # idle: wait; a request for 2 steps arrives: step, drain without waiting, step; idle again: wait twice
    log = run_loop([["req:2"], [], [], []])
    check_blocking(log)
    steps = [event for event in log if event[0] == "run"]
    assert len(steps) == 2, (
        f"a request with 2 steps of work got {len(steps)} engine steps (run_batch); the loop steps the engine "
        f"once per turn while engine.has_work. What the loop did: {log}"
    )
    sends = [event for event in log if event[0] == "send"]
    assert len(sends) == 2 and all(log[log.index(send) - 1] == ("run",) for send in sends), (
        f"each step's outputs go to the detokenizer right after the step (send_outputs(run_batch())); "
        f"what the loop did: {log}"
    )


def test_messages_are_processed_before_the_step_that_follows_them():
    # Two requests arrive together while idle; a third and an abort arrive while the engine runs.
    log = run_loop([["req:1", "req:1"], ["req:3"], ["abort"], []])
    check_blocking(log)
    expected = [
        ("recv", True, False),
        ("process", "req:1"),
        ("process", "req:1"),
        ("run",),
        ("send", ["outputs of step 1"]),
        ("recv", False, True),
        ("process", "req:3"),
        ("run",),
        ("send", ["outputs of step 2"]),
        ("recv", False, True),
        ("process", "abort"),
        ("recv", True, False),
        ("recv", True, False),  # the script is over: this recv ends the test
    ]
    assert log == expected, (
        "every message a recv returns is processed before the engine's next step (a request that arrived "
        "joins that step: continuous batching; an abort frees its slots before it), and after an abort that "
        f"leaves no work the loop does not step.\n  expected: {expected}\n  the loop did: {log}"
    )


def test_what_run_batch_raises_ends_the_loop():
    """run_batch already turns a failed step into errors for its requests; what it raises means
    the engine's state is broken (its invariants, fatal_error), and the process must end: the
    launcher then stops the server. A loop that catches it would serve on from a broken state."""
    scheduler = ScriptedScheduler([["req:2"], [], []])
    scheduler.fail_with = RuntimeError("the engine's state is broken")
    try:
        scheduler.event_loop()
    except RuntimeError as error:
        assert error is scheduler.fail_with
    except LoopEnded:
        raise AssertionError(
            "run_batch raised RuntimeError (broken invariants) and the loop went on until its script ended: the loop "
            "must not catch what run_batch raises (run_batch already answers a failed step's requests with an error)"
        ) from None
    else:
        raise AssertionError("the loop returned; it ends only by an exception")


class RecordingEngine:
    """Takes requests and writes down the SamplingParams each came with."""

    def __init__(self):
        self.added: list[SamplingParams] = []

    def add_request(self, input_ids, sampling_params, rid=None):
        self.added.append(sampling_params)
        return rid


def test_a_request_without_max_tokens_may_run_to_the_end_of_the_context():
    scheduler = SchedulerProcess.__new__(SchedulerProcess)  # no sockets, no engine: only what the handler uses
    scheduler.engine, scheduler.reqs, scheduler.context_len = RecordingEngine(), {}, 64
    prompt = list(range(10))
    # As to_sampling_params leaves it: max_new_tokens 1 (a placeholder SamplingParams accepts) and the flag.
    scheduler.handle_generate_request(
        TokenizedGenerateReqInput("r", prompt, SamplingParams(max_new_tokens=1), fill_max_new_tokens=True)
    )
    [params] = scheduler.engine.added
    assert params.max_new_tokens == 64 - 10 + 1, (
        "a request without max_tokens (fill_max_new_tokens) may generate until its prompt and output fill the context "
        f"(64 - 10 + 1 = 55 new tokens, the last one's K/V never stored); the engine got max_new_tokens="
        f"{params.max_new_tokens}: pass the params with max_new_tokens filled in, not req.sampling_params"
    )
