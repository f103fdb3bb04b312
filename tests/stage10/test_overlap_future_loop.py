"""Stage 10 (graded): the overlapped loop itself.

- the future map resolves negative ids from its buffer and leaves real tokens alone;
- with overlap, step N+1 is launched before step N's results are processed, a decoding request
  feeds a future id (negative) that is resolved at the start of the forward, and the forward
  runs on the worker thread; without overlap, each step is processed before the next is built
  and no future id is ever fed;
- a turn of the loop returns while the step it launched still runs, and launches step N+1 while
  step N's forward still runs (the forward is held by the test to see it).
"""

from __future__ import annotations

import threading

import pytest
import torch

from overlap_helpers import engine_on, greedy, random_prompt, step_until_idle
from s10_overlap_scheduling.future_map import FutureMap


def test_future_map_resolves_placeholders_only():
    futures = FutureMap(4, "cpu")
    first, second = futures.alloc(2), futures.alloc(2)
    assert first == [-1, -2] and second == [-3, -4]
    futures.store(first, torch.tensor([17, 99]))
    futures.store(second, torch.tensor([5, 0]))
    ids = torch.tensor([3, -2, 250, -1, -4, 0, -3])
    try:
        futures.resolve(ids)
    except IndexError as error:
        raise AssertionError(
            f"resolve({[3, -2, 250, -1, -4, 0, -3]}) with 4 stored tokens raised IndexError ({error}): a future id -k "
            "names slot k of the buffer (index with the NEGATED id), and a real token id (>= 0) is no index at all: "
            "look up only where the id is negative"
        ) from error
    assert ids.tolist() == [3, 99, 250, 17, 0, 0, 5], (
        "resolve must replace each negative id -k by the token stored at k and leave every real token id as it is, "
        f"in place; got {ids.tolist()}"
    )
    assert futures.alloc(1) == [-1], "the buffer is a ring: after its capacity it starts again at -1"
    with pytest.raises(ValueError, match="capacity"):
        futures.alloc(5)


def stage8_tokens(path) -> list[int]:
    """What stage 8 generates for the one request these loop tests run."""
    return engine_on(path, stage=8, pool_size=512).generate([random_prompt(7, seed=3)], greedy(4))[0].output_ids


def spied_engine(path, disable_overlap):
    """An engine whose scheduler logs ("launch", n) / ("process", n) events and, for each forward,
    how many future ids its input carried before and after resolving, and on which thread."""
    engine = engine_on(path, disable_overlap=disable_overlap, pool_size=512)
    scheduler, log, passes = engine.scheduler, [], []
    launches = iter(range(1, 10_000))

    real_launch, real_process = scheduler.schedule_and_launch, scheduler.process_batch_result_overlap
    real_resolve = scheduler.future_map.resolve

    def schedule_and_launch():
        launched = real_launch()
        if launched is not None:
            launched.number = next(launches)
            log.append(("launch", launched.number))
        return launched

    def process(launched, *args):
        log.append(("process", launched.number))
        return real_process(launched, *args)

    def resolve(input_ids):
        before = int((input_ids < 0).sum())
        real_resolve(input_ids)
        passes.append((before, int((input_ids < 0).sum()), threading.current_thread()))

    scheduler.schedule_and_launch, scheduler.process_batch_result_overlap = schedule_and_launch, process
    scheduler.future_map.resolve = resolve
    return engine, log, passes


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_step_n_plus_1_is_launched_before_step_n_is_processed(tiny_models_root, disable_overlap):
    path = tiny_models_root / "llama3"
    engine, log, passes = spied_engine(path, disable_overlap)
    req = engine.add_request(random_prompt(7, seed=3), greedy(4))
    first = engine.step()
    step_until_idle(engine, f"llama3, overlap {'off' if disable_overlap else 'on'}")
    if disable_overlap:
        assert [out.new_token_ids for out in first] == [req.output_ids[:1]], (
            "without overlap a step returns its own token"
        )
        assert log == [(kind, n) for n in range(1, 5) for kind in ("launch", "process")], log
        assert all(before == 0 for before, _, _ in passes), f"without overlap no input is a future id: {passes}"
        return
    assert first == [], (
        f"with overlap the first step() launches step 1 and returns before its results exist: it returned {first}"
    )
    assert log == [
        ("launch", 1),
        ("launch", 2),
        ("process", 1),
        ("launch", 3),
        ("process", 2),
        ("launch", 4),
        ("process", 3),
        ("process", 4),
    ], (
        f"the loop's order was {log}: with overlap step N+1 is launched before step N is processed, and a request "
        "whose last token (max_new_tokens) is in flight is not scheduled again"
    )
    assert [before for before, _, _ in passes] == [0, 1, 1, 1], (
        f"future ids fed per forward: {[b for b, _, _ in passes]}; the prefill feeds none, each decode feeds the "
        "future id of the token step N has not returned yet"
    )
    assert all(after == 0 for _, after, _ in passes), "a future id was still negative after resolve"
    assert all(thread is not threading.main_thread() for _, _, thread in passes), (
        "the forward must run on the worker thread"
    )
    stage8 = stage8_tokens(path)
    assert req.output_ids == stage8, (
        f"with overlap the request got {req.output_ids}, stage 8 gives {stage8}: each turn processes step N after "
        "launching step N+1, and only then settles step N+1 (the requests that finished in step N get no future id)"
    )


HELD_WAIT_S = 30  # a turn that does not wait for the held forward returns in milliseconds


def test_a_turn_returns_while_the_step_it_launched_still_runs(tiny_models_root):
    """The point of overlap: a turn hands step N+1 to the worker and goes on; the CPU waits only
    for step N's results, after launching step N+1. The forward is held until the test lets it go."""
    path = tiny_models_root / "llama3"
    engine = engine_on(path, pool_size=512)
    scheduler, real_forward, real_launch = engine.scheduler, engine.runner.forward, engine.scheduler.schedule_and_launch
    gate, second_launched, launches = threading.Event(), threading.Event(), []

    def held_forward(batch):
        gate.wait()
        return real_forward(batch)

    def schedule_and_launch():
        launched = real_launch()
        if launched is not None:
            launches.append(launched)
            if len(launches) == 2:
                second_launched.set()
        return launched

    def turn():
        with torch.inference_mode():  # per thread
            engine.step()

    engine.runner.forward, scheduler.schedule_and_launch = held_forward, schedule_and_launch
    req = engine.add_request(random_prompt(7, seed=3), greedy(4))
    try:
        first = threading.Thread(target=turn, daemon=True)
        first.start()
        first.join(HELD_WAIT_S)
        assert not first.is_alive(), (
            "the first step() did not return while the forward of the step it launched was held: it waited for that "
            "step's results. With overlap a turn launches step N+1 and goes on; it waits only for step N, and there "
            "is no step N before the first"
        )
        second = threading.Thread(target=turn, daemon=True)
        second.start()
        assert second_launched.wait(HELD_WAIT_S), (
            "the second step() did not launch step 2 while step 1's forward was still running: a turn schedules and "
            "launches step N+1 first, and only then waits for step N's results (unless must_wait_for_last())"
        )
    finally:
        gate.set()
    second.join()
    step_until_idle(engine, "llama3, the forward held")
    stage8 = stage8_tokens(path)
    assert req.output_ids == stage8, f"with the forward held, the request got {req.output_ids}; stage 8: {stage8}"


def test_between_steps_a_decoding_request_ends_with_a_future_id(tiny_models_root):
    """After a step, each running request's newest output id names the token of the step in flight;
    the next step's processing replaces it by the real token."""
    engine = engine_on(tiny_models_root / "qwen2", pool_size=512)
    reqs = [engine.add_request(random_prompt(n, seed=n), greedy(5)) for n in (4, 9)]
    with torch.inference_mode():
        engine.step()
        engine.step()
    futures = [req.output_ids[-1] for req in reqs]
    assert all(f < 0 for f in futures) and len(set(futures)) == 2, (
        f"after two steps each request should end with its own future id (negative): {[r.output_ids for r in reqs]}"
    )
    assert all(t >= 0 for req in reqs for t in req.output_ids[:-1])
