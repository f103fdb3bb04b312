"""Shared by the stage 6-9 tests: check the scheduler's and the radix tree's invariants, saying where."""

from __future__ import annotations


def check_all(engine, what: str) -> None:
    """Raise AssertionError (prefixed with ``what``) unless the engine's memory bookkeeping holds."""
    engine.scheduler.check_invariants()
    if engine.tree_cache is not None:
        try:
            engine.tree_cache.check()
        except AssertionError as error:
            raise AssertionError(f"{what}: {error}") from None
