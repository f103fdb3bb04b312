"""Checking a request's grammar before it is served, in worker processes that can be stopped.

The server checks each grammar before its request reaches the scheduler, so a schema that does
not compile is a 400 naming the problem. llguidance bounds most of the work a grammar can cause
(``PARSER_LIMITS``), but not all of it: deciding whether an intersection of patterns (a JSON
schema's ``allOf`` of several ``pattern`` strings) can match anything takes time and memory that
roughly double with each pattern (measured on a 2-core machine: 16 patterns 1.5 s and 0.1 GB, 18
patterns 5 s and 0.5 GB, 22 patterns over 5 GB within a minute), and no limit of the library
stops it. A thread cannot be stopped, so the checks run in a few worker processes
(``GrammarChecker``), each under a cap on its memory (``RLIMIT_AS``, where the system has it):

- a check that outlasts ``timeout_s`` is a 400 ("took longer than"), and its worker is killed;
- a check that passes the cap kills its worker (the library cannot allocate): a 400 too;
- either worker is replaced, so the next request finds the same number of workers;
- a request that finds every worker busy for ``timeout_s`` gets a 503 with Retry-After: the
  server is busy, which is not the fault of its grammar;
- a refused grammar is remembered (``GrammarMemory``), and so is a check under way: the same
  grammar sent again, by one client or many at once, costs a worker once, not every time (a
  refusal at the time or memory cap, which may owe to the machine's load, for a minute only).

This module imports only llguidance (no torch), so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import llguidance

if TYPE_CHECKING:
    from .sampling_params import GrammarKey

# llguidance's own bounds on the work one grammar may cause (its defaults are 1M / 500k): with
# them most hostile schemas fail in bounded time instead of compiling for minutes.
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, max_grammar_size=200_000)
# The JSON the model may write: compact (no free whitespace), so a model cannot pad forever
JSON_OPTIONS = {"whitespace_flexible": False}
CHECK_WORKERS = 2  # grammars checked at once
CHECK_TIMEOUT_S = 5.0  # a check that takes longer is refused; a request waits for a free worker as long
CHECK_MEMORY_BYTES = 1 << 30  # a worker's address space (a check of an ordinary schema uses a few MB)
# The refusals remembered: their keys' text, and a message that may quote it a few times (at most ~5 MB)
REFUSALS_KEPT, REFUSAL_CHARS_KEPT = 256, 1_000_000
# A check stopped at the time or memory cap says what this machine could do then, under its load
# then: that refusal is remembered for this long only, and the grammar is checked anew after it.
# (The library's own verdict, a grammar that is malformed, holds for good.)
STOPPED_REFUSAL_KEPT_S = 60.0

V = TypeVar("V")


class GrammarError(ValueError):
    """A schema or regex that does not compile; the message says what is wrong."""


class GrammarCheckBusy(RuntimeError):
    """Every worker stayed busy for the whole wait: the server is busy, not the grammar wrong."""


def grammar_text(key: GrammarKey) -> str:
    """llguidance's grammar for ``key``. Raises GrammarError for a malformed one."""
    kind, text = key
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        return llguidance.LLMatcher.grammar_from_regex(text)
    except ValueError as error:
        raise GrammarError(f"{kind}: {error}") from None


def kind_name(key: GrammarKey) -> str:
    """What ``key`` is, in a client's words."""
    return "JSON schema" if key[0] == "json" else "regex"


def check_grammar(key: GrammarKey) -> None:
    """Raise GrammarError unless ``key`` compiles (no tokenizer needed). In this process: the
    server calls it through ``GrammarChecker``, which bounds its time and memory."""
    error = llguidance.LLMatcher.validate_grammar(grammar_text(key), limits=llguidance.LLParserLimits(**PARSER_LIMITS))
    if error:
        raise GrammarError(f"invalid {kind_name(key)}: {error}")


def serve_checks(conn: Connection, memory_bytes: int) -> None:
    """A worker's loop: a key in, None (it compiles) or the reason it does not, out."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):
        pass  # no such limit here (Windows; macOS may refuse it): the time limit still holds
    conn.send("ready")
    while True:
        try:
            key = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        try:
            check_grammar(key)
            conn.send(None)
        except GrammarError as error:
            conn.send(str(error))
        except MemoryError:
            conn.send(f"the grammar needs more than {memory_bytes >> 20} MB to check; simplify it")


class GrammarMemory(Generic[V]):
    """Values by grammar key, bounded: at most ``max_grammars`` of them and ``max_chars``
    characters of grammar text, the least recently used going first."""

    def __init__(self, max_grammars: int, max_chars: int):
        self.max_grammars, self.max_chars = max_grammars, max_chars
        self.entries: OrderedDict[GrammarKey, V] = OrderedDict()  # least recently used first
        self.chars = 0  # grammar text held, the measure of what the values take

    def get(self, key: GrammarKey) -> V | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)  # just used: evicted last
        return value

    def __setitem__(self, key: GrammarKey, value: V) -> None:
        if key in self.entries:  # replaced: its text is counted again below
            del self.entries[key]
            self.chars -= len(key[1])
        self.entries[key] = value
        self.chars += len(key[1])
        # The newest entry stays even when it alone is over max_chars: its request is using it.
        while len(self.entries) > 1 and (len(self.entries) > self.max_grammars or self.chars > self.max_chars):
            evicted, _ = self.entries.popitem(last=False)
            self.chars -= len(evicted[1])

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries


class CheckWorker:
    """One worker process and the server's end of its pipe."""

    def __init__(self, memory_bytes: int):
        self.conn, child = mp.Pipe()
        self.process = mp.get_context("spawn").Process(
            target=serve_checks, args=(child, memory_bytes), name="grammar-check", daemon=True
        )
        self.process.start()
        child.close()
        if not self.conn.poll(60) or self.conn.recv() != "ready":  # its imports, before any check's clock starts
            self.stop()
            raise RuntimeError("a grammar check worker did not start within 60 s")

    def check(self, key: GrammarKey, timeout_s: float) -> tuple[bool, str | None]:
        """(whether the worker lives on, the reason the grammar is refused or None)."""
        self.conn.send(key)
        if not self.conn.poll(timeout_s):
            return False, f"the grammar took longer than {timeout_s:g} s to check; simplify it"
        try:
            return True, self.conn.recv()
        except (EOFError, OSError):  # it died: the memory cap (the library aborts when it cannot allocate)
            return False, "the grammar needs more memory to check than this server allows; simplify it"

    def stop(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class GrammarChecker:
    """``workers`` processes that check grammars, each check within ``timeout_s`` and
    ``memory_bytes``; ``check`` is awaited on the server's event loop."""

    def __init__(
        self,
        workers: int = CHECK_WORKERS,
        timeout_s: float = CHECK_TIMEOUT_S,
        memory_bytes: int = CHECK_MEMORY_BYTES,
        stopped_refusal_kept_s: float = STOPPED_REFUSAL_KEPT_S,
    ):
        self.workers, self.timeout_s, self.memory_bytes = workers, timeout_s, memory_bytes
        self.stopped_refusal_kept_s = stopped_refusal_kept_s
        self.idle: asyncio.Queue[CheckWorker] | None = None  # made on the event loop, at the first check
        self.all: set[CheckWorker] = set()
        self.tasks: set[asyncio.Task[Any]] = set()  # checks and replacements under way (the loop keeps weak refs)
        # A grammar refused once (a slow one included: the check that timed out cost a worker for
        # timeout_s) is refused at once after, with the same message, while remembered: its
        # message and until when (the loop's clock). This does not stop a client that sends
        # ever-different slow grammars: each costs a worker once.
        self.refused = GrammarMemory[tuple[str, float]](REFUSALS_KEPT, REFUSAL_CHARS_KEPT)
        self.checking: dict[GrammarKey, asyncio.Task[str | None]] = {}  # the checks under way, by key

    async def check(self, key: GrammarKey) -> None:
        """Return if ``key`` compiles; GrammarError saying why not (or that it took too long or
        too much memory); GrammarCheckBusy if no worker was free within ``timeout_s``. A key
        refused before, or being checked for another request, takes no worker of its own."""
        refused = self.remembered(key)
        if refused is None and key not in self.checking:
            worker = await self.free_worker()
            refused = self.remembered(key)
            if refused is not None or key in self.checking:  # decided, or started, while this request waited
                assert self.idle is not None
                self.idle.put_nowait(worker)
            else:
                self.checking[key] = self.background(self.run_on(worker, key))
        if refused is None:
            # Shielded: a request cancelled meanwhile (its client gone, its time up) must not lose
            # the worker, which goes back to the queue, or is replaced, whatever happens to the request.
            refused = await asyncio.shield(self.checking[key])
        if refused is not None:
            raise GrammarError(refused)

    def remembered(self, key: GrammarKey) -> str | None:
        """Why ``key`` was refused, while that is remembered; else None."""
        message, until = self.refused.get(key) or ("", 0.0)
        return message if asyncio.get_running_loop().time() < until else None

    async def free_worker(self) -> CheckWorker:
        """A worker, once one is free (the first call starts them); GrammarCheckBusy after ``timeout_s``."""
        if self.idle is None:
            self.idle = asyncio.Queue()
            for _ in range(self.workers):
                self.idle.put_nowait(await self.start_worker())
        try:
            return await asyncio.wait_for(self.idle.get(), self.timeout_s)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
            raise GrammarCheckBusy(
                f"all {self.workers} grammar checks of this server were busy for {self.timeout_s:g} s; retry"
            ) from None

    async def run_on(self, worker: CheckWorker, key: GrammarKey) -> str | None:
        """Check ``key`` on ``worker`` and remember a refusal, then give the worker back, or stop
        it and start another."""
        assert self.idle is not None
        try:
            lives, refused = await asyncio.to_thread(worker.check, key, self.timeout_s)
        finally:
            del self.checking[key]
        if refused is not None:
            kept = math.inf if lives else self.stopped_refusal_kept_s
            self.refused[key] = (refused, asyncio.get_running_loop().time() + kept)
        if lives:
            self.idle.put_nowait(worker)
        else:
            self.all.discard(worker)
            await asyncio.to_thread(worker.stop)
            self.background(self.replace())
        return refused

    def background(self, work) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def start_worker(self) -> CheckWorker:
        worker = await asyncio.to_thread(CheckWorker, self.memory_bytes)
        self.all.add(worker)
        return worker

    async def replace(self) -> None:
        assert self.idle is not None
        self.idle.put_nowait(await self.start_worker())

    def close(self) -> None:
        for worker in self.all:
            worker.stop()
        self.all.clear()
