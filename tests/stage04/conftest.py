"""Stage 4's tests check the pool's bookkeeping after every step of every static batch they run
(as the lesson promises): each KV page is free or held by exactly one running request (its table
row up to cached_len), and each table row is free or held by exactly one running request."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported in the fixture: a learner's stage 4 that does not import fails its tests, not pytest
    from s04_paged_kv_pool.engine import StaticBatchEngine


def check_static_batch(engine: StaticBatchEngine, where: str) -> None:
    """Raise AssertionError, saying where, unless the pool and the table rows are consistent."""
    runner = engine.runner
    table, rows = runner.req_to_token_pool.req_to_token, runner.req_to_token_pool
    running = list(engine.running)
    problems = []
    try:
        runner.allocator.check_invariants([table[req.req_pool_idx, : req.cached_len] for req in running])
    except AssertionError as error:
        legend = ", ".join(f"owner {i} = request {req.rid}" for i, req in enumerate(running)) or "no request runs"
        problems.append(f"{error} ({legend})")
        if "leaked" in str(error):
            problems.append(
                "a running request owns the slots of its table row up to cached_len (after each pass "
                "cached_len = device_len); a finished request gives them back: release() frees them "
                "(allocator.free) as well as the row itself"
            )
    held = sorted(req.req_pool_idx for req in running)
    if sorted(held + list(rows.free_slots)) != list(range(rows.size)):
        problems.append(
            f"table rows: running requests hold {held}, free rows are {sorted(rows.free_slots)}; together "
            f"they should be 0..{rows.size - 1}, each once (release() frees a finished request's row, once)"
        )
    if problems:
        raise AssertionError(f"{where}: the pool's bookkeeping is broken:\n  " + "\n  ".join(problems))


@pytest.fixture(autouse=True)
def invariants_after_every_step(monkeypatch):
    """Every StaticBatchEngine.step of the test is followed by check_static_batch."""
    from s04_paged_kv_pool.engine import StaticBatchEngine

    real_step = StaticBatchEngine.step
    steps: dict[int, int] = {}

    def checked_step(self):
        finished = real_step(self)
        steps[id(self)] = steps.get(id(self), 0) + 1
        check_static_batch(
            self, f"static batch, after step {steps[id(self)]} (finished: {[req.rid for req in finished]})"
        )
        return finished

    monkeypatch.setattr(StaticBatchEngine, "step", checked_step)
