"""The server's grammar checks run in worker processes that a hostile schema cannot outgrow.

An ``allOf`` of ``pattern`` strings makes llguidance decide whether their intersection matches
anything, at a cost that roughly doubles per pattern and that none of its limits stops (22
patterns took over 5 GB of the API server's memory within a minute, in a thread that could not be
stopped). Here: such a check is refused at the time limit, or when its worker passes the memory
cap, the worker is replaced and the next check is served; a request that finds every worker busy
is told to retry (GrammarCheckBusy, a 503), not that its grammar is wrong; a request cancelled
while its check runs loses no worker.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from s11_structured_output.grammar_check import GrammarCheckBusy, GrammarChecker, GrammarError


def patterns(n: int) -> tuple[str, str]:
    """A JSON-schema key whose check costs time and memory exponential in ``n``."""
    schema = {"allOf": [{"type": "string", "pattern": f".*{chr(97 + i)}.*"} for i in range(n)]}
    return ("json", json.dumps(schema))


GOOD = ("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


def run(coro):
    return asyncio.run(coro)


def test_a_check_past_the_time_limit_is_refused_and_its_worker_replaced():
    async def scenario():
        checker = GrammarChecker(workers=1, timeout_s=1.0)
        try:
            await checker.check(GOOD)
            [first] = checker.all
            started = time.monotonic()
            with pytest.raises(GrammarError, match="took longer than 1 s"):
                await checker.check(patterns(24))  # minutes and gigabytes, unbounded
            took = time.monotonic() - started
            assert took < 15, f"the hostile check was answered after {took:.1f} s, not at the 1 s limit"
            assert not first.process.is_alive(), "the worker running the hostile check must be killed"
            await checker.check(GOOD)  # waits for the replacement
            assert len(checker.all) == 1 and first not in checker.all
            with pytest.raises(GrammarError, match="unclosed"):
                await checker.check(("regex", "[0-9"))
        finally:
            checker.close()
        assert not any(worker.process.is_alive() for worker in [first])

    run(scenario())


def test_a_check_past_the_memory_cap_ends_its_worker_not_the_server():
    async def scenario():
        # 18 patterns need ~0.5 GB within ~5 s here: under a 256 MB cap the worker dies first
        checker = GrammarChecker(workers=1, timeout_s=60.0, memory_bytes=256 << 20)
        try:
            with pytest.raises(GrammarError, match="memory|took longer"):
                await checker.check(patterns(20))
            await checker.check(GOOD)
        finally:
            checker.close()

    run(scenario())


def test_every_worker_busy_is_a_retry_not_a_refused_grammar():
    async def scenario():
        checker = GrammarChecker(workers=1, timeout_s=0.5)
        try:
            await checker.check(GOOD)
            assert checker.idle is not None
            held = await checker.idle.get()  # the only worker, busy elsewhere
            with pytest.raises(GrammarCheckBusy, match="retry"):
                await checker.check(GOOD)
            checker.idle.put_nowait(held)
            await checker.check(GOOD)
        finally:
            checker.close()

    run(scenario())


def test_a_request_cancelled_during_its_check_loses_no_worker():
    async def scenario():
        checker = GrammarChecker(workers=1, timeout_s=1.0)
        try:
            await checker.check(GOOD)
            hostile = asyncio.create_task(checker.check(patterns(24)))
            await asyncio.sleep(0.2)
            hostile.cancel()  # its client left: the check goes on, and its worker is then replaced
            with pytest.raises(asyncio.CancelledError):
                await hostile
            while checker.tasks:  # the check, killed at its limit, then the replacement's start
                await asyncio.gather(*list(checker.tasks), return_exceptions=True)
            assert len(checker.all) == 1, f"{len(checker.all)} workers after the cancelled check, not 1"
            await checker.check(GOOD)
        except GrammarCheckBusy:
            pytest.fail("the cancelled request's worker was lost: no worker came back, nor a replacement")
        finally:
            checker.close()

    run(scenario())


def test_a_refusal_at_the_time_limit_is_remembered_for_a_while_only():
    """Sent again, a grammar refused at the time limit is refused at once with the same message
    (no worker spends the limit on it again), but only for ``stopped_refusal_kept_s``: the limit
    was hit under that moment's load, so later it is checked anew. A malformed grammar, the
    library's own verdict, stays refused."""

    async def timed(checker, key) -> tuple[str, float]:
        started = time.monotonic()
        with pytest.raises(GrammarError) as refused:
            await checker.check(key)
        return str(refused.value), time.monotonic() - started

    async def scenario():
        checker = GrammarChecker(workers=1, timeout_s=1.0, stopped_refusal_kept_s=3.0)
        try:
            first, took = await timed(checker, patterns(24))
            assert "took longer than 1 s" in first and took >= 1.0, (first, took)
            again, took = await timed(checker, patterns(24))
            assert again == first and took < 0.5, f"sent again within the minute: {again!r} after {took:.2f} s"
            bad, _ = await timed(checker, ("regex", "[0-9"))
            await asyncio.sleep(3.0)
            later, took = await timed(checker, patterns(24))
            assert later == first and took >= 1.0, f"past stopped_refusal_kept_s it is checked anew; {took:.2f} s"
            assert checker.remembered(("regex", "[0-9")) == bad, "the library's own verdict is remembered for good"
        finally:
            checker.close()

    run(scenario())
