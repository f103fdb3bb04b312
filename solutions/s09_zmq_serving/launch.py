"""Start the four processes, serve until told to stop, and leave nothing behind.

    python -m s09_zmq_serving --model ... --port 30000 [engine knobs]
        │
        ├── API server (this process: FastAPI + uvicorn)        binds ipc://.../api_server.ipc
        ├── tokenizer worker      (multiprocessing, "spawn")    binds ipc://.../tokenizer.ipc
        ├── scheduler (the engine)                              binds ipc://.../scheduler.ipc
        └── detokenizer worker                                  binds ipc://.../detokenizer.ipc

The sockets live in a private temporary folder, removed at the end. Each child reports "ready"
(or why it failed) through a pipe; the HTTP port opens once all three are ready. Stopping:

- Ctrl-C / SIGTERM reach this process: every request in flight is told the server is stopping
  (a stream gets a last SSE error event and ends properly), uvicorn finishes, then the children
  are terminated (and killed if they linger) and joined. Children ignore Ctrl-C themselves (a
  terminal sends it to the whole process group): the launcher decides when they stop.
- A child that dies stops the whole server with the reason: "the scheduler process exited: ...".
  Requests in flight get that message. No request can do that (each worker survives whatever
  one message raises, worker_loop.py): only a fault the process cannot recover from, such as
  the scheduler's invariants broken, or an exercise not written yet.
- If the launcher itself dies without cleaning up (kill -9), each child notices that its parent
  changed, removes the socket folder and exits within a second.

Every process logs through ``logging`` in one format that names the process, at ``--log-level``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import cast

from .detokenizer_manager import run_detokenizer_process
from .io_struct import describe_error
from .scheduler_process import run_scheduler_process
from .server_args import ServerArgs
from .tokenizer_manager import run_tokenizer_process
from .worker_loop import Heartbeats

logger = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s"

CHILDREN = {
    "scheduler": run_scheduler_process,
    "tokenizer": run_tokenizer_process,
    "detokenizer": run_detokenizer_process,
}
STOP_TIMEOUT_S = 5  # a terminated child gets this long before it is killed


@dataclass(frozen=True)
class IpcPaths:
    """Where each process's PULL socket is bound."""

    tokenizer: str
    scheduler: str
    detokenizer: str
    api_server: str

    @property
    def folder(self) -> str:
        return os.path.dirname(self.tokenizer[len("ipc://") :])

    @classmethod
    def in_folder(cls, folder: str) -> "IpcPaths":
        return cls(
            *(
                f"ipc://{os.path.join(folder, name)}.ipc"
                for name in ("tokenizer", "scheduler", "detokenizer", "api_server")
            )
        )


class ChildExited(RuntimeError):
    """A worker process ended on its own; the message says which and why."""


def setup_logging(level: str, process: str) -> None:
    """This process's logging: one format for every process, naming it, at ``level``."""
    logging.basicConfig(format=LOG_FORMAT.format(process=process), level=level.upper(), force=True)


def watch_parent(parent_pid: int, folder: str) -> None:
    """Exit this process as soon as its parent is gone (it was re-parented), removing the socket
    folder the parent can no longer remove."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def child_main(
    name: str, server_args: ServerArgs, ipc: IpcPaths, conn, parent_pid: int, heartbeats: Heartbeats
) -> None:
    """What each child process runs: its worker, reporting ready or its error through ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(server_args.log_level, name)
    watch_parent(parent_pid, ipc.folder)
    try:
        CHILDREN[name](server_args, ipc, lambda info: conn.send(("ready", info)), heartbeats)
    except BaseException as error:
        if not (isinstance(error, NotImplementedError) and str(error).startswith("Stage ")):
            logger.critical("the %s process ends", name, exc_info=True)
        try:
            conn.send(("error", describe_error(error)))
        finally:
            os._exit(1)


class Launcher:
    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.folder = tempfile.mkdtemp(prefix="engine-ipc-")
        self.ipc = IpcPaths.in_folder(self.folder)
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.conns: dict[str, multiprocessing.connection.Connection] = {}
        self.errors: dict[str, str] = {}
        self.stopping = False
        self.spawn = mp.get_context("spawn")  # a fresh interpreter: no inherited torch threads or sockets
        self.heartbeats = Heartbeats(self.spawn)

    def start_children(self) -> dict[str, dict]:
        """Start every child and wait until each is ready; returns what each reported."""
        spawn = self.spawn
        for name in CHILDREN:
            reader, writer = spawn.Pipe(duplex=False)
            proc = spawn.Process(
                target=child_main,
                args=(name, self.server_args, self.ipc, writer, os.getpid(), self.heartbeats),
                name=f"engine-{name}",
                daemon=True,
            )
            proc.start()
            writer.close()
            self.procs[name], self.conns[name] = proc, reader
        infos: dict[str, dict] = {}
        while len(infos) < len(CHILDREN):
            waiting = [n for n in CHILDREN if n not in infos]
            # Wake up when a child reports (ready or its error) or when one dies without a word.
            mp.connection.wait([self.conns[n] for n in waiting] + [self.procs[n].sentinel for n in waiting])
            for name in waiting:
                message = self._read(name)
                if message is not None and message[0] == "ready":
                    infos[name] = message[1]
                elif message is not None or not self.procs[name].is_alive():
                    raise ChildExited(self.exit_message(name))
        return infos

    def _read(self, name: str):
        conn = self.conns[name]
        try:
            if conn.poll():
                message = conn.recv()
                if message[0] == "error":
                    self.errors[name] = message[1]
                return message
        except (EOFError, OSError):
            pass
        return None

    def exit_message(self, name: str) -> str:
        proc = self.procs[name]
        proc.join(timeout=1)
        self._read(name)
        why = self.errors.get(name) or f"exit code {proc.exitcode} (see the messages above)"
        return f"the {name} process exited: {why}"

    def dead_child(self) -> str | None:
        """Why a child is gone (None while every child lives)."""
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return self.exit_message(name)
        return None

    def monitor(self, on_death) -> None:
        """In a thread: call ``on_death(message)`` when a child dies while serving."""

        def watch():
            sentinels = {self.procs[n].sentinel: n for n in CHILDREN}
            ready = mp.connection.wait(list(sentinels))
            if not self.stopping:
                on_death(self.exit_message(sentinels[cast(int, ready[0])]))  # wait() returns what it was given

        threading.Thread(target=watch, name="watch-children", daemon=True).start()

    def stop_children(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.folder, ignore_errors=True)


class Terminated(Exception):
    """SIGTERM arrived: stop like Ctrl-C does."""


def _on_sigterm(signum, frame):
    raise Terminated()


def launch_server(server_args: ServerArgs) -> int:
    """Run the server until Ctrl-C / SIGTERM (returns 0) or until a child dies (returns 1)."""
    from .api_server import SHUTTING_DOWN, create_app
    from .http_server import make_http_server
    from .protocol import Limits

    setup_logging(server_args.log_level, "api_server")
    signal.signal(signal.SIGTERM, _on_sigterm)  # also while the children load the model
    launcher = Launcher(server_args)
    fatal: list[str] = []
    try:
        infos = launcher.start_children()
        pids = {"api_server": os.getpid(), **{name: proc.pid for name, proc in launcher.procs.items()}}
        names = server_args.model_names()
        scheduler, tokenizer = infos["scheduler"], infos["tokenizer"]
        context = scheduler["context_len"]
        limits = Limits(
            context_len=context,
            vocab_size=scheduler["vocab_size"],
            prompt_vocab_size=tokenizer["vocab_size"],
            max_prompt_chars=server_args.max_prompt_chars or context * tokenizer["max_token_chars"],
        )
        app = create_app(
            server_args,
            limits,
            scheduler["max_running_requests"],
            launcher.ipc,
            pids,
            launcher.dead_child,
            launcher.heartbeats,
        )

        tell_everyone = app.state.serving.fail_all_from_any_thread
        server = make_http_server(app, server_args, on_exit=lambda: tell_everyone(SHUTTING_DOWN, 503))

        def on_death(message: str) -> None:
            fatal.append(message)
            logger.error("%s; stopping the server", message)
            tell_everyone(message, 500)
            server.should_exit = True

        launcher.monitor(on_death)
        # One write, newline included: unbuffered (PYTHONUNBUFFERED, python -u) print() writes its
        # text and its end apart, and a child's death logged by the monitor between them would land
        # in the middle of this line.
        print(
            f"serving {names[0]} on http://{server_args.host}:{server_args.port}/v1 "
            f"(device {scheduler['device']}, context {context} tokens, pids {pids}); Ctrl-C stops it\n"
            + "".join(f"  {line}\n" for line in scheduler["engine"].splitlines()),
            end="",
            flush=True,
        )
        server.run()
    except ChildExited as error:
        logger.error("%s", error)
        return 1
    except (KeyboardInterrupt, Terminated):
        pass
    finally:
        launcher.stop_children()
    return 1 if fatal else 0
