"""Shared by the stage-9 tests: a server in a child process that fails fast and says why, the
offline engine's answers to compare with, and small HTTP helpers.

ENGINE_SERVER_START_TIMEOUT (seconds, default 240) is how long a test waits for a server to
answer /health; on a busy machine (a whole class graded at once, say) raise it."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import openai
import pytest
import requests
import urllib3
from openai import AsyncOpenAI

from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s08_cuda_graph.engine import CudaGraphEngine  # the engine these servers run (SERVED_ENGINE)
from s09_zmq_serving.server_process import ServerProcess
from soak_serving import stream_problems
from stuck_watch import qualname_from_source, timed_out_after

STARTUP_TIMEOUT_S = float(os.environ.get("ENGINE_SERVER_START_TIMEOUT", "240"))
PIDS_LINE = re.compile(r"pids (\{.*?\})\); Ctrl-C")  # the launcher's startup line
TRACEBACK_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')  # a frame of a logged traceback

# After a request that got no answer in time, one good request must be answered within this
# (a tiny model answers one token in well under a second): else the server is not waited on again.
CANARY_TIMEOUT_S = 15
CANARY_REQUEST = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
FAILED_SERVER_GRACE_S = 2  # how long a failed test waits to see whether its server is going down

TINY_FAMILY = "llama"
# Every stage-9 server serves stage 8's engine: without --disable-overlap the server runs stage
# 10's, and stage 9's tests must pass with stages 1-9 written (stage 10 tests its own server).
SERVED_ENGINE = ["--disable-overlap"]
# The tiny server: room for 40+ requests at once, a 1024-token context (the tiny models' own).
TINY_ARGS = ["--pool-size", "4096", "--max-running-requests", "48", *SERVED_ENGINE]
DEFAULT_ARGS = ["--pool-size", "2048", *SERVED_ENGINE]
# A chat template that uses a message's name (the tiny models' own, plus " name" after the role).
NAMED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m['name'] %} {{ m['name'] }}{% endif %}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The guarded server: every guard tight enough for a test to reach it quickly.
GUARD_KEY = "sk-stage9-test"
GUARD_LIMITS = dict(
    max_request_bytes=65536,
    max_running_requests=2,
    max_queued_requests=1,
    read_timeout=2,
    keep_alive_timeout=1,
    request_timeout=3,
    health_timeout=1,
    max_connections=16,
)
# The crowded server: 16 connections at most, and the default --read-timeout (30 s): room to see
# stalled connections closed before the header deadline would close them.
CROWDED_CONNECTIONS = 16
CROWDED_ARGS = ["--pool-size", "1024", *SERVED_ENGINE, f"--max-connections={CROWDED_CONNECTIONS}"]
GUARD_ARGS = [
    "--pool-size",
    "4096",
    *SERVED_ENGINE,
    *[f"--{name.replace('_', '-')}={value}" for name, value in GUARD_LIMITS.items()],
]


class Server:
    """A running server (``python -m s09_zmq_serving``) and its log, for the tests.

    ``debug``: serve /debug/state and /debug/fault (``--enable-debug-endpoints``); ``metrics``: serve
    /metrics (``--enable-metrics``); ``api_key``:
    the server's key, sent with every request these helpers make. The log goes in ``log_dir``:
    pytest's own temporary folder, which keeps the last three runs (a failure can be read there
    afterwards) and deletes older ones."""

    def __init__(
        self,
        model: Path,
        args: list[str],
        log_dir: Path,
        new_session: bool = False,
        debug: bool = True,
        metrics: bool = True,
        api_key: str | None = None,
    ):
        self.model = model
        self.headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.unanswered: str | None = None  # a test whose request got no answer in time (see check_answering)
        self.silent: str | None = None  # why the server is not asked again
        fd, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=log_dir)
        self.log_path, self.log = Path(name), os.fdopen(fd, "w")
        self.log_mark = 0  # the byte where the current test's part of the log starts (mark_log)
        flags = [
            *(["--enable-debug-endpoints"] if debug else []),
            *(["--enable-metrics"] if metrics else []),
            *(["--api-key", api_key] if api_key else []),
        ]
        self.process = ServerProcess(["--model", str(model), *flags, *args], log=self.log, new_session=new_session)
        self.base_url = self.process.base_url
        try:
            self.process.wait_ready(STARTUP_TIMEOUT_S)
            return
        except RuntimeError as error:
            problem = str(error)
        self.stop()
        if "did not answer" in problem:
            problem += (
                f" (the machine may be busy: raise ENGINE_SERVER_START_TIMEOUT, in seconds, now {STARTUP_TIMEOUT_S:g})"
            )
        pytest.fail(f"the server on {model.name} did not start: {problem}\n{self.why()}", pytrace=False)

    def log_text(self, start: int = 0) -> str:
        """The log from byte ``start`` on (all of it by default)."""
        if not self.log.closed:
            self.log.flush()
        with self.log_path.open("rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")

    def mark_log(self) -> None:
        """Remember where the log ends now (a test starts): ``unwritten_exercise`` reads what follows.
        (The server's processes write to the file itself: nothing of theirs waits in a buffer here.)"""
        self.log_mark = self.log_path.stat().st_size

    def unwritten_exercise(self) -> tuple[tuple[str, int, str], str] | None:
        """The first exercise not written yet that raised in one of the server's processes since
        ``mark_log``: the frame that raised it (file, line, function) and its message; else None.
        A traceback's text names a method without its class on every Python, so the class comes
        from the source: the exercise reads as the tests in this process name it."""
        frame = None
        for line in self.log_text(self.log_mark).splitlines():
            if found := TRACEBACK_FRAME.match(line):
                filename, number = found[1], int(found[2])
                frame = (filename, number, qualname_from_source(filename, number, found[3]))
            elif line.startswith("NotImplementedError: Stage ") and frame is not None:
                return frame, line.removeprefix("NotImplementedError: ")
        return None

    def why(self) -> str:
        """The server's own words: its error lines, else the end of its log."""
        lines = self.log_text().splitlines()
        errors = [line for line in lines if re.search(r" (ERROR|CRITICAL) |error:|Error:|not written yet", line)]
        return "\n".join(errors[-8:] or lines[-15:])

    def pids(self) -> dict[str, int]:
        """The four processes' pids, from the launcher's startup line."""
        found = PIDS_LINE.search(self.log_text())
        assert found, f"the server's startup line (with its pids) is not in its log:\n{self.why()}"
        return ast.literal_eval(found.group(1))

    def check_alive(self) -> None:
        code = self.process.proc.poll()
        if code is not None:
            pytest.fail(f"the server on {self.model.name} has exited (code {code}):\n{self.why()}", pytrace=False)

    def failure_note(self) -> tuple[str | None, str]:
        """For a test on this server that failed: (its exit, if it died during the test, else None;
        what to read: why it died, or where its log is, which holds any traceback of a request)."""
        try:  # a worker that died takes the server down within a moment (the launcher stops the rest)
            code = self.process.proc.wait(timeout=FAILED_SERVER_GRACE_S)
        except subprocess.TimeoutExpired:
            return None, f"its log, with any traceback from its processes: {self.log_path}"
        died = f"the server on {self.model.name} exited (code {code}) during this test"
        return died, f"{died}:\n{self.why()}\n(its log: {self.log_path})"

    def note_failure(self, nodeid: str, error: BaseException) -> bool:
        """A test on this server failed with ``error``: if it waited in vain for an answer, remember
        the test (check_answering asks before the next one) and say True."""
        if not waited_in_vain(error):
            return False
        self.unanswered = self.unanswered or nodeid
        return True

    def check_answering(self) -> None:
        """After a test whose request got no answer in time (``unanswered``): one good request of
        one token, given CANARY_TIMEOUT_S. Answered: the server is trusted again. Not: this test
        and every later one on this server fail at once, instead of each waiting minutes."""
        if self.unanswered is None:
            return
        if self.silent is not None:
            pytest.fail(self.silent, pytrace=False)
        try:
            canary = CANARY_REQUEST | {"model": self.model.name}
            answer = post(self, "/v1/completions", canary, timeout=CANARY_TIMEOUT_S)
            if answer.status_code == 200:
                self.unanswered = None
                return
            got = f"it answered {answer.status_code}: {answer.text[:200]}"
        except requests.exceptions.RequestException as error:
            got = f"no answer within {CANARY_TIMEOUT_S:g} s ({type(error).__name__})"
        self.silent = f"not run: the server on {self.model.name} does not answer (the first 'not run' above says why)"
        pytest.fail(
            f"not run: the server on {self.model.name} left a request of {self.unanswered} unanswered, and a "
            f"one-token completion sent since got {got}. Does every request reach the engine, and do its "
            "outputs go back through the detokenizer? (Every later test on this server fails at once.)\n" + self.why(),
            pytrace=False,
        )

    def get(self, path: str, timeout: float = 60) -> requests.Response:
        return requests.get(self.base_url + path, headers=self.headers, timeout=timeout)

    def debug_state(self) -> dict:
        answer = self.get("/debug/state")
        assert answer.status_code == 200, f"GET /debug/state answered {answer.status_code}: {answer.text[:300]}"
        return answer.json()

    def arm_fault(self, process: str, kind: str = "raise", seconds: float = 0) -> None:
        """The next request ``process`` handles raises or stalls (POST /debug/fault)."""
        answer = post(self, "/debug/fault", {"process": process, "kind": kind, "seconds": seconds})
        assert answer.status_code == 200, f"POST /debug/fault answered {answer.status_code}: {answer.text[:300]}"

    def health(self) -> requests.Response:
        return requests.get(self.base_url + "/health", timeout=30)

    def stop(self, sig: int = signal.SIGTERM, group: bool = False, timeout: float = 30) -> int:
        code = self.process.stop(sig, group, timeout)
        self.log.close()
        return code


def wait_idle(server: Server, what: str, timeout: float = 20) -> dict:
    """/debug/state once nothing runs or waits (fails after ``timeout`` seconds, saying why)."""
    deadline = time.monotonic() + timeout
    while True:
        state = server.debug_state()
        if state["running"] == state["waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    untracked = state.get("untracked_requests")
    assert state["running"] == state["waiting"] == 0, (
        f"{what}: {timeout:.0f} s later the scheduler still has {state['running']} running and {state['waiting']} "
        "waiting "
        "requests: the requests of clients that went away were not aborted"
        + (
            f". The engine still runs {untracked}, which the scheduler process no longer tracks: its abort_request "
            "dropped them from self.reqs without engine.abort_request, so they keep running and hold their KV"
            if untracked
            else ""
        )
    )
    return state


def assert_nothing_leaked(state: dict, what: str) -> None:
    """With nothing running: the invariants hold, no process keeps a request (scheduler, detokenizer,
    API server), nothing is locked, and every KV slot is free or held by the radix tree."""
    assert state["invariants"] == "ok", (
        f"{what}: the scheduler's / radix tree's invariants are broken:\n{state['invariants']}"
    )
    assert state["tracked_requests"] == 0, (
        f"{what}: the scheduler process still tracks {state['tracked_requests']} requests"
    )
    if "open_requests" in state:  # the server's /debug/state; the in-process tests pass the scheduler's alone
        assert state["detokenizer_requests"] == 0, (
            f"{what}: the detokenizer still keeps the text of {state['detokenizer_requests']} requests: a request's "
            "end (an abort too) must reach the detokenizer, which then forgets it"
        )
        assert state["detokenizer_logprob_streams"] == 0, (
            f"{what}: the detokenizer still keeps the log-probabilities of {state['detokenizer_logprob_streams']} "
            "requests: they must be forgotten with the request's text"
        )
        assert state["detokenizer_failed"] == 0, (
            f"{what}: the detokenizer still waits for the end of {state['detokenizer_failed']} failed requests"
        )
        assert state["open_requests"] == 0, f"{what}: the API server still holds {state['open_requests']} answer queues"
    assert state["tree_locked_tokens"] == 0, (
        f"{what}: {state['tree_locked_tokens']} cached tokens are still locked by nobody"
    )
    held = state["pool_size"] - state["free_slots"]
    assert held == state["tree_cached_tokens"], (
        f"{what}: nothing runs, yet {held} KV slots are taken while the radix tree holds "
        f"{state['tree_cached_tokens']}: "
        "an aborted request did not free its KV"
    )


def pid_running(pid: int) -> bool:
    """True if ``pid`` is a live process (a zombie waiting to be reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" not in status


def wait_gone(pids, timeout: float) -> list[int]:
    """The pids still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if pid_running(pid)]
    return alive


def offline_engine(path: Path, **knobs) -> CudaGraphEngine:
    """The same engine in this process (the model and tokenizer loaded once per test session)."""
    return CudaGraphEngine(engine_model(str(path)), engine_tokenizer(str(path)), **knobs)


def offline_outputs(engine: CudaGraphEngine, prompts, params):
    """engine.generate's outputs; checks nothing was rejected."""
    outputs = engine.generate(prompts, params)
    for i, out in enumerate(outputs):
        assert out.error is None, f"the offline engine rejected prompt {i}: {out.error}"
    return outputs


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_tokens, **more)


def stream_concurrently(server: Server, kind: str, requests_: list[dict]) -> list[tuple[str, str | None]]:
    """Every request (the openai client's arguments) sent at once and streamed, ``kind`` "chat" or
    "completions"; returns each one's (text, finish_reason), in order. Checks each stream's shape:
    one finish reason, on its last choice chunk, and a usage chunk only if stream_options asked."""

    async def one(aclient: AsyncOpenAI, request: dict):
        create = aclient.chat.completions.create if kind == "chat" else aclient.completions.create
        chunks = [chunk async for chunk in await create(stream=True, **request)]
        check_stream_shape(
            [chunk.model_dump() for chunk in chunks], kind, request, f"a streamed {kind} request {request}"
        )
        pieces = [
            (choice.delta.content or "") if kind == "chat" else choice.text
            for chunk in chunks
            for choice in chunk.choices
        ]
        finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        return "".join(pieces), (finish[-1] if finish else None)

    async def all_of_them():
        aclient = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=180)
        try:
            return await asyncio.gather(*(one(aclient, request) for request in requests_))
        finally:
            await aclient.close()

    return asyncio.run(all_of_them())


def check_stream_shape(chunks: list[dict], kind: str, request: dict, what: str) -> None:
    """A streamed answer's chunks (JSON, without [DONE]): the right object, for each of its n
    choices exactly one finish reason, on that choice's last chunk; then a usage-only chunk (no
    choices) if and only if the request asked for it with stream_options.include_usage
    (tools/soak_serving.py checks)."""
    asked = bool((request.get("stream_options") or {}).get("include_usage"))
    problems = stream_problems(chunks, kind == "chat", asked, request.get("n") or 1)
    assert not problems, f"{what}: " + "; ".join(problems)


def waited_in_vain(error: BaseException | None) -> bool:
    """Whether a test failed because an answer never came: a read timeout of requests (also inside
    a stream, where requests wraps urllib3's) or of the openai client, or pytest's own limit."""
    while error is not None:
        if isinstance(error, (requests.exceptions.Timeout, openai.APITimeoutError)):
            return True
        if isinstance(error, requests.exceptions.ConnectionError) and any(
            isinstance(arg, urllib3.exceptions.ReadTimeoutError) for arg in error.args
        ):
            return True
        if timed_out_after(error) is not None:
            return True
        error = error.__cause__ or error.__context__
    return False


def post(
    server: Server, path: str, body=None, data: str | bytes | None = None, timeout: float = 120, stream: bool = False
) -> requests.Response:
    headers = {**server.headers, "Content-Type": "application/json"}
    if body is not None:
        data = json.dumps(body)
    return requests.post(server.base_url + path, data=data, headers=headers, timeout=timeout, stream=stream)


def assert_openai_error(answer: requests.Response, status: int, what: str) -> dict:
    """The OpenAI error an answer holds, after checking its status and fields."""
    assert answer.status_code == status, (
        f"{what}: expected status {status}, got {answer.status_code}: {answer.text[:300]}"
    )
    try:
        error = answer.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(
            f"{what}: the body must be OpenAI's {{'error': {{...}}}}; got {answer.text[:300]}"
        ) from None
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], (
        f"{what}: the error must hold message, type, param and code; got {error}"
    )
    return error


def read_sse(response: requests.Response) -> list:
    """The JSON chunks of an SSE answer (checks it ends with data: [DONE])."""
    events = [line[len("data: ") :] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", (
        f"a stream must end with 'data: [DONE]'; its last events were {events[-2:]}"
    )
    return [json.loads(e) for e in events[:-1]]
