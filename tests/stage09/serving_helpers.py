"""Shared by the stage-9 tests: a server in a child process that fails fast and says why, the
offline engine's answers to compare with, and small HTTP helpers."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import requests
from openai import AsyncOpenAI

from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s09_zmq_serving.scheduler_process import Engine  # the engine the server runs
from s09_zmq_serving.server_process import ServerProcess

STARTUP_TIMEOUT_S = 240


class Server:
    """A running server (``python -m s09_zmq_serving``) and its log, for the tests.

    The log goes in ``log_dir``: pytest's own temporary folder, which keeps the last three runs
    (a failure can be read there afterwards) and deletes older ones."""

    def __init__(self, model: Path, args: list[str], log_dir: Path, new_session: bool = False):
        self.model = model
        fd, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=log_dir)
        self.log_path, self.log = Path(name), os.fdopen(fd, "w")
        self.process = ServerProcess(["--model", str(model), *args], log=self.log, new_session=new_session)
        self.base_url = self.process.base_url
        try:
            self.process.wait_ready(STARTUP_TIMEOUT_S)
            return
        except RuntimeError as error:
            problem = str(error)
        self.stop()
        pytest.fail(f"the server on {model.name} did not start: {problem}\n{self.why()}", pytrace=False)

    def why(self) -> str:
        """The server's own words: its error lines, else the end of its log."""
        if not self.log.closed:
            self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        errors = [line for line in lines if "error:" in line or "not written yet" in line]
        return "\n".join(errors[-5:] or lines[-15:])

    def check_alive(self) -> None:
        code = self.process.proc.poll()
        if code is not None:
            pytest.fail(f"the server on {self.model.name} has exited (code {code}):\n{self.why()}", pytrace=False)

    def debug_state(self) -> dict:
        answer = requests.get(self.base_url + "/debug/state", timeout=60)
        assert answer.status_code == 200, f"GET /debug/state answered {answer.status_code}: {answer.text[:300]}"
        return answer.json()

    def stop(self, sig: int = signal.SIGTERM, group: bool = False, timeout: float = 30) -> int:
        code = self.process.stop(sig, group, timeout)
        self.log.close()
        return code


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


def offline_engine(path: Path, **knobs) -> Engine:
    """The same engine in this process (the model and tokenizer loaded once per test session)."""
    return Engine(engine_model(str(path)), engine_tokenizer(str(path)), **knobs)


def offline_outputs(engine: Engine, prompts, params):
    """engine.generate's outputs; checks nothing was rejected."""
    outputs = engine.generate(prompts, params)
    for i, out in enumerate(outputs):
        assert out.error is None, f"the offline engine rejected prompt {i}: {out.error}"
    return outputs


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_tokens, **more)


def stream_concurrently(server: Server, kind: str, requests_: list[dict]) -> list[tuple[str, str | None]]:
    """Every request (the openai client's arguments) sent at once and streamed, ``kind`` "chat" or
    "completions"; returns each one's (text, finish_reason), in order."""

    async def one(aclient: AsyncOpenAI, request: dict):
        create = aclient.chat.completions.create if kind == "chat" else aclient.completions.create
        pieces, finish = [], None
        async for chunk in await create(stream=True, **request):
            for choice in chunk.choices:
                pieces.append((choice.delta.content or "") if kind == "chat" else choice.text)
                finish = choice.finish_reason or finish
        return "".join(pieces), finish

    async def all_of_them():
        aclient = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=180)
        try:
            return await asyncio.gather(*(one(aclient, request) for request in requests_))
        finally:
            await aclient.close()

    return asyncio.run(all_of_them())


def post(server: Server, path: str, body=None, data: str | None = None, timeout: float = 120) -> requests.Response:
    if data is not None:
        return requests.post(server.base_url + path, data=data, headers={"Content-Type": "application/json"}, timeout=timeout)
    return requests.post(server.base_url + path, json=body, timeout=timeout)


def read_sse(response: requests.Response) -> list:
    """The JSON chunks of an SSE answer (checks it ends with data: [DONE])."""
    import json

    events = [line[len("data: "):] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"a stream must end with 'data: [DONE]'; its last events were {events[-2:]}"
    return [json.loads(e) for e in events[:-1]]
