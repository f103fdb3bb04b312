"""`make lab`: JupyterLab on notebooks/, on this machine only, with the course's kernel.

The kernel is the virtual environment's Python with the implementation switch installed
(tools/switch_site on its PYTHONPATH), so a notebook's `import s04_paged_kv_pool` comes from the
tree the ENGINE_* settings choose: the reference by default, your stages/ with ENGINE_IMPL=stages
(and ENGINE_REFERENCE_UPTO=K to borrow stages 1..K). Its kernel spec is written under a temporary
folder placed first on JUPYTER_PATH and named "python3", the name the notebooks ask for, so no
other Python 3 kernel installed on the machine can stand in for it.

    python tools/lab.py [jupyter lab options]         # e.g. --no-browser --port 8890
    ENGINE_IMPL=stages python tools/lab.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import impl_switch
from notebook_setup import engine_line

NOTEBOOKS = impl_switch.REPO / "notebooks"
KERNEL_NAME = "python3"  # what every notebook's metadata names


def write_kernel_spec(data_dir: Path, switch: impl_switch.Switch, pythonpath: str) -> Path:
    """A kernel spec for this Python with the switch's settings and ``pythonpath`` (which holds
    tools/switch_site); returns its folder."""
    folder = data_dir / "kernels" / KERNEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 (engine: {engine_line(switch)})",
        "language": "python",
        "env": {**switch.to_env(), "PYTHONPATH": pythonpath},
    }
    (folder / "kernel.json").write_text(json.dumps(spec, indent=1))
    return folder


def main(argv: list[str]) -> int:
    try:
        switch = impl_switch.install()  # checks the settings; puts them and switch_site in os.environ
    except impl_switch.SwitchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="engine-lab-") as data_dir:
        write_kernel_spec(Path(data_dir), switch, os.environ["PYTHONPATH"])
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [data_dir, os.environ.get("JUPYTER_PATH")]))
        print(
            f"JupyterLab on {NOTEBOOKS}, kernel: engine {engine_line(switch)}; Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        command = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.root_dir={NOTEBOOKS}",
            f"--MappingKernelManager.default_kernel_name={KERNEL_NAME}",
            *argv,
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-root")  # containers and CI run as root; the server still listens on localhost only
        lab = subprocess.Popen(command)
        # Ctrl-C reaches JupyterLab too, which asks before it stops; wait for it (and then remove the
        # kernel spec) instead of leaving it running. A SIGTERM is passed on.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: lab.terminate())
        return lab.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
