"""`make lab` (tools/lab.py): JupyterLab answers on localhost, and a notebook run through its REST
and kernel API imports the engine through the implementation switch (not graded).

The server is started headless, as `make lab ARGS="--no-browser ..."` would start it; the first
code cells of notebook 04 run on the kernel it offers, and their first output names the engine and
the device. With ENGINE_IMPL=stages the kernel it writes imports the learner's tree instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests
import websocket  # websocket-client, which jupyter-server depends on

import lab as lab_tool  # tools/lab.py
from impl_switch import SWITCH_VARS
from s09_zmq_serving.server_process import free_port  # (a port below the ephemeral range)

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = "04_paged_kv_pool.ipynb"  # its first two code cells: set-up (loads the model), then KV bytes per token


class Lab:
    """tools/lab.py in its own process group, on a free port with a known token."""

    def __init__(self, tmp_path: Path):
        self.port, self.token = free_port(), uuid.uuid4().hex
        self.base = f"http://127.0.0.1:{self.port}"
        # no ENGINE_* settings: the reference by default, as `make lab` runs it
        env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS}
        env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
        self.log = (tmp_path / "lab.log").open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "tools/lab.py",
                "--no-browser",
                f"--port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
            ],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.log_path = tmp_path / "lab.log"

    def get(self, path: str, **params):
        return requests.get(f"{self.base}{path}", params={"token": self.token, **params}, timeout=30)

    def kernel_channel(self, notebook: str):
        """A session for ``notebook`` on the server's default kernel, and that kernel's websocket."""
        session = requests.post(
            f"{self.base}/api/sessions",
            params={"token": self.token},
            timeout=60,
            json={"path": notebook, "type": "notebook", "name": notebook},
        ).json()
        return websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/api/kernels/{session['kernel']['id']}/channels?token={self.token}", timeout=300
        )

    def wait_until_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"tools/lab.py exited with {self.process.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if self.get("/api/status").status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        pytest.fail(
            f"JupyterLab did not answer on {self.base} within {timeout} s:\n{self.log_path.read_text()[-3000:]}"
        )

    def run_cells(self, notebook: str, count: int) -> list[str]:
        """Start a session for ``notebook`` on the server's default kernel, run its first ``count``
        code cells over the kernel's websocket; returns each cell's printed text."""
        cells = self.get(f"/api/contents/{notebook}", content=1).json()["content"]["cells"]
        sources = [
            "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells
            if c["cell_type"] == "code"
        ]
        channel = self.kernel_channel(notebook)
        try:
            return [execute(channel, source) for source in sources[:count]]
        finally:
            channel.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def execute(channel, code: str) -> str:
    """Run ``code`` on the kernel behind ``channel``; its stdout, or a failure with its error."""
    msg_id = uuid.uuid4().hex
    channel.send(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "msg_type": "execute_request",
                    "username": "test",
                    "session": uuid.uuid4().hex,
                    "version": "5.3",
                },
                "parent_header": {},
                "metadata": {},
                "channel": "shell",
                "buffers": [],
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": False,
                    "user_expressions": {},
                    "allow_stdin": False,
                },
            }
        )
    )
    out = []
    while True:
        message = json.loads(channel.recv())
        if message.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = message["msg_type"], message["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error":
            pytest.fail(f"the cell raised {content['ename']}: {content['evalue']}\n{code[:400]}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


@pytest.fixture
def server(tmp_path):
    lab = Lab(tmp_path)
    try:
        lab.wait_until_up()
        yield lab
    finally:
        lab.stop()


def test_lab_runs_a_notebook_on_the_reference_by_default(server, default_model_dir):
    assert server.get("/lab").status_code == 200, "JupyterLab's page did not load"
    specs = server.get("/api/kernelspecs").json()
    default = specs["kernelspecs"][specs["default"]]["spec"]
    assert specs["default"] == "python3" and "engine: the reference" in default["display_name"], (
        f"the default kernel should be the course's python3 kernel on the reference engine, got {specs['default']}: "
        f"{default}"
    )
    assert default["argv"][0] == sys.executable, (
        f"the kernel should run this environment's Python, not {default['argv'][0]}"
    )
    setup, table = server.run_cells(NOTEBOOK, 2)
    first_line = setup.splitlines()[0]
    assert first_line.startswith("engine: the reference (solutions/)") and "device: cpu" in first_line, (
        f"notebook {NOTEBOOK}'s first output should name the engine and the device, got {first_line!r}"
    )
    assert "SmolLM2-135M       30        3       64     45.0 KiB" in table, (
        f"the notebook's second cell should print the default model's KV bytes per token:\n{table}"
    )


def test_with_engine_impl_stages_the_kernel_imports_your_code(tmp_path):
    """The kernel spec tools/lab.py writes under ENGINE_IMPL=stages, run as Lab would run it (its argv's
    Python, its env over the server's): stage packages come from the trees the switch says."""
    switch = lab_tool.impl_switch.Switch.from_env({"ENGINE_IMPL": "stages", "ENGINE_REFERENCE_UPTO": "2"})
    folder = lab_tool.write_kernel_spec(tmp_path, switch, str(lab_tool.impl_switch.SWITCH_SITE))
    spec = json.loads((folder / "kernel.json").read_text())
    assert "your code (stages/; stages 1-2 from solutions/)" in spec["display_name"], spec["display_name"]
    probe = (
        "import importlib.util as u; print(u.find_spec('s02_request_and_sampling').origin); "
        "print(u.find_spec('s03_kv_cache').origin)"
    )
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS}
    done = subprocess.run(
        [spec["argv"][0], "-c", probe],
        env={**env, **spec["env"]},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    earlier, own = done.stdout.split()
    assert Path(earlier).is_relative_to(REPO / "solutions") and Path(own).is_relative_to(REPO / "stages"), (
        f"with ENGINE_IMPL=stages ENGINE_REFERENCE_UPTO=2 the kernel should import stage 2 from solutions/ and stage 3 "
        f"from stages/; it found {earlier} and {own}\n{done.stderr[-2000:]}"
    )
