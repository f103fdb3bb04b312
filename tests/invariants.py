"""Shared by the stage 6 and 7 tests: check the scheduler's and the radix tree's invariants, saying where."""

from __future__ import annotations


def check_all(engine, what: str) -> None:
    """Raise AssertionError (prefixed with ``what``) unless the engine's memory bookkeeping holds."""
    try:
        engine.scheduler.check_invariants()
        if engine.tree_cache is not None:
            engine.tree_cache.check()
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None
