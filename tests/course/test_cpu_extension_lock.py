"""A build of the C++ kernels that was killed midway must not stall the next one (not graded:
provided code, s00 cpu_extension.py).

``torch.utils.cpp_extension`` marks a build in progress with a file in the build folder and deletes
it when done; a process killed in between (a server stopped while it starts, Ctrl-C in the wrong
second) leaves it, and every later load of that kernel used to wait for it forever, printing
nothing. Here a real process takes that file the way cpp_extension does and is killed with it held;
then a real build of a one-line library must load, and the file be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from s00_foundation import cpu_extension

BUILD = """
import sys
from pathlib import Path
from s00_foundation import cpu_extension
print(cpu_extension.build("engine_answer", [Path(sys.argv[1])]))
"""
HOLD = """
import sys, time
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_build_killed_while_it_held_cpp_extensions_lock_does_not_stall_the_next(tmp_path, monkeypatch):
    if cpu_extension.switched_off() or not cpu_extension.shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no C++ compiler here (or ENGINE_CPU_KERNELS=off): nothing is built")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "answer.cpp"
    source.write_text('extern "C" int engine_answer() { return 42; }\n')
    where = cpu_extension.build_folder("engine_answer", [source, cpu_extension.INCLUDE / cpu_extension.HEADER])

    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(where / "lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)  # no Python cleanup runs: the lock file stays, as after a kill -9
    holder.wait(timeout=30)
    assert (where / "lock").exists()

    try:
        done = subprocess.run([sys.executable, "-c", BUILD, str(source)], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the build waited 3 minutes for the lock a killed process left in {where}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("(True, "), done.stdout + done.stderr[-2000:]
    assert not (where / "lock").exists()


def test_a_process_that_waits_for_a_live_build_says_so_and_goes_on_when_it_ends(tmp_path, capsys):
    pytest.importorskip("fcntl", reason="Windows: only cpp_extension's own lock file")
    hold = (
        "import fcntl, sys, time\n"
        "handle = open(sys.argv[1], 'w'); fcntl.flock(handle, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(3)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "flock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    (tmp_path / "lock").touch()  # cpp_extension's file of the live build: the waiter must not touch it yet
    started = time.monotonic()
    with cpu_extension.alone_in(tmp_path, "engine_k", note_after_s=0.2):
        waited = time.monotonic() - started
        assert waited > 1.0, f"entered after {waited:.2f} s, while the other process held the lock for 3 s"
        assert not (tmp_path / "lock").exists()
    assert holder.wait(timeout=30) == 0
    assert f"[engine_k] waiting for another process building or loading it in {tmp_path}" in capsys.readouterr().err


def test_two_torch_installations_build_in_folders_of_their_own(tmp_path, monkeypatch):
    """cpp_extension's build file names torch's include folder: two checkouts, each with its own
    venv, that shared a folder rewrote that file in turn and rebuilt while the other waited (a
    reader's notebooks waited a minute on another checkout's build)."""
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "answer.cpp"
    source.write_text('extern "C" int engine_answer() { return 42; }\n')
    here = cpu_extension.build_folder("engine_answer", [source])
    assert cpu_extension.build_folder("engine_answer", [source]) == here  # the same installation: the same folder
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert cpu_extension.build_folder("engine_answer", [source]) != here
