"""Stage 10 (graded): the cases that make overlap hard.

- A request that finishes at step N (a stop token, a stop string) was already scheduled for step
  N+1: its stream ends at step N, step N+1's token for it is dropped, its slots and table row are
  freed, and the radix tree ends up holding exactly what stage 8's does.
- Aborts of a request in the step in flight, of a half-prefilled one and of a waiting one; an
  abort in flight keeps the K/V the step in flight computed.
- Everything else stays token-identical to transformers, and the invariants hold after every step.
"""

from __future__ import annotations

import pytest

from overlap_helpers import assert_pool_free_after_tree, engine_on, greedy, random_prompt, run_checked, tree_paths
from reference import assert_same_tokens, hf_greedy


def count_calls(scheduler, name: str) -> list:
    """Wrap ``scheduler.<name>`` (on this instance); returns the list its calls' first argument is
    appended to."""
    calls, real = [], getattr(scheduler, name)

    def counted(first, *rest, **kwargs):
        calls.append(first)
        return real(first, *rest, **kwargs)

    setattr(scheduler, name, counted)
    return calls


def early_stop_workload(path):
    """Requests that stop on a token they produce early (their third, or first), so they finish
    before max_new_tokens, and what each must produce (transformers' tokens up to that stop)."""
    prompts = [random_prompt(n, seed=200 + n) for n in (5, 17, 8, 26, 3, 12)]
    params, expected = [], []
    for i, prompt in enumerate(prompts):
        full = hf_greedy(path, prompt, 12)
        stop = full[0 if i % 3 == 2 else 2]
        params.append(greedy(12, stop_token_ids=[stop]))
        expected.append(full[: full.index(stop) + 1])
    return prompts, params, expected


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_request_finished_but_already_scheduled_drops_its_extra_token(tiny_models_root, page_size):
    path = tiny_models_root / "llama"
    prompts, params, expected = early_stop_workload(path)
    knobs = dict(pool_size=1024, page_size=page_size, chunked_prefill_size=8)
    stage8 = engine_on(path, stage=8, **knobs)
    run_checked(stage8, prompts, params, "stage 8")
    for disable_overlap in (False, True):
        what = f"llama, page_size={page_size}, {'no ' if disable_overlap else ''}overlap"
        engine = engine_on(path, disable_overlap=disable_overlap, **knobs)
        ended_in_flight = count_calls(engine.scheduler, "release_ended")
        reqs, streams = run_checked(engine, prompts, params, what)
        for i, (req, ref) in enumerate(zip(reqs, expected)):
            assert_same_tokens(streams[req.rid], ref, f"{what}: request {i}'s stream (it stops on token {ref[-1]})")
            assert req.finished_reason.type == "stop", (
                f"{what}: request {i} ended with {req.finished_reason}, not its stop token"
            )
        dropped = engine.scheduler.dropped_tokens
        if disable_overlap:
            assert dropped == 0, (
                f"{what}: {dropped} tokens were dropped, but without overlap nothing runs after its end"
            )
        elif ended_in_flight:
            assert dropped == len(ended_in_flight), (
                f"{what}: {len(ended_in_flight)} request(s) had ended when a step that held them was processed "
                f"(release_ended ran for them), each with a token sampled after its end, yet dropped_tokens is "
                f"{dropped}: process_sampled drops such a token and counts it (self.dropped_tokens += 1), what overlap "
                "wastes"
            )
        else:
            assert dropped > 0, (
                f"{what}: no request ran a step after its stop token, so the finished-but-scheduled "
                "case never happened: is step N+1 really scheduled before step N is processed?"
            )
        assert_pool_free_after_tree(engine, what)
        assert tree_paths(engine.tree_cache) == tree_paths(stage8.tree_cache), (
            f"{what}: the radix tree holds other token paths than stage 8's after the same requests: a finished "
            "request must insert its K/V once, with its real tokens, for all positions but its last (the dropped "
            "step's extra position is freed, never inserted)"
        )


def test_a_stop_string_under_overlap(tiny_models_root):
    path = tiny_models_root / "qwen2"
    # a prompt whose fourth greedy token is a printable byte: that character is the stop string
    prompt, full = next(
        (p, f)
        for p, f in ((random_prompt(9, seed=s), None) for s in range(200))
        for f in [hf_greedy(path, p, 10)]
        if 32 <= f[3] < 127
    )
    stop = chr(full[3])
    engine = engine_on(path, pool_size=512)
    [req], streams = run_checked(engine, [prompt], [greedy(10, stop=[stop])], "qwen2, stop string")
    ends = full.index(full[3]) + 1
    assert_same_tokens(streams[req.rid], full[:ends], f"qwen2, stop string {stop!r}: the stream")
    assert req.finished_reason.matched == stop
    assert engine.scheduler.dropped_tokens == 1, "the request was scheduled once more before its stop string was seen"
    assert_pool_free_after_tree(engine, "qwen2, stop string")


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_aborts_in_flight_half_prefilled_and_waiting(tiny_models_root, disable_overlap):
    path = tiny_models_root / "qwen3"
    what = f"qwen3, aborts, {'no ' if disable_overlap else ''}overlap"
    prompts = [
        random_prompt(6, seed=1),
        random_prompt(60, seed=2),
        random_prompt(7, seed=3),
        random_prompt(5, seed=4),
        random_prompt(9, seed=5),
    ]
    limits = [20, 8, 9, 6, 7]
    engine = engine_on(
        path,
        disable_overlap=disable_overlap,
        pool_size=512,
        page_size=4,
        chunked_prefill_size=16,
        max_running_requests=3,
    )
    scheduler = engine.scheduler
    original_abort = engine.abort_request
    seen = {}

    def abort(rid):
        holders = [*scheduler.running, *scheduler.waiting, *([scheduler.chunked_req] if scheduler.chunked_req else [])]
        req = next(r for r in holders if r.rid == rid)
        state = (
            "waiting"
            if req in scheduler.waiting
            else "half"
            if req.cached_len < len(req.origin_input_ids)
            else "running"
        )
        in_flight = scheduler.last is not None and any(r is req for r in scheduler.last.batch.reqs)
        seen[rid] = (state, in_flight)
        return original_abort(rid)

    engine.abort_request = abort
    # after step 2: request 0 decodes in the step in flight; request 1 (60 tokens, chunks of 16) is
    # half prefilled; request 4 waits (3 rows)
    reqs, streams = run_checked(engine, prompts, [greedy(n) for n in limits], what, aborts={2: [0], 3: [1, 4]})
    for i in (0, 1, 4):
        assert reqs[i].finished_reason.type == "abort", (
            f"{what}: request {i} ended with {reqs[i].finished_reason}, not abort"
        )
        assert all(t >= 0 for t in reqs[i].output_ids), (
            f"{what}: aborted request {i} kept a future id: {reqs[i].output_ids}"
        )
    for i in (2, 3):
        assert_same_tokens(
            reqs[i].output_ids, hf_greedy(path, prompts[i], limits[i]), f"{what}: request {i} vs transformers"
        )
    assert seen[0][0] == "running" and seen[1][0] == "half" and seen[4][0] == "waiting", f"{what}: test set-up: {seen}"
    if not disable_overlap:
        assert seen[0][1], f"{what}: request 0 was meant to be aborted while in the step in flight (test set-up)"
    assert_pool_free_after_tree(engine, what)


def test_a_request_aborted_in_flight_keeps_its_table_row_from_admission(tiny_models_root):
    """Two table rows, three requests: the third waits. The first is aborted while in the step in
    flight: it leaves the running list at once, but its row is freed only when that step is
    processed, so the next turn may not admit the third into it (a row counted free too early is
    a PoolExhaustedError mid-admission, which fails every request of the step)."""
    path = tiny_models_root / "llama3"
    what = "llama3, 2 table rows, an abort in flight"
    engine = engine_on(path, pool_size=512, max_running_requests=2)
    prompts = [random_prompt(n, seed=90 + n) for n in (5, 8, 6)]
    try:
        reqs, _ = run_checked(engine, prompts, greedy(6), what, aborts={2: [0]})
    except Exception as error:
        if "PoolExhaustedError" not in type(error).__name__:
            raise
        raise AssertionError(
            f"{what}: {error}\n  admission counted the aborted request's row as free while the step in flight still "
            "held it: the rows in use are those of every request holding memory (reqs_holding_memory(): the ending "
            "ones too), not only the running ones"
        ) from None
    assert reqs[0].finished_reason.type == "abort", f"{what}: request 0 should end aborted: {reqs[0].finished_reason}"
    for i in (1, 2):
        assert_same_tokens(reqs[i].output_ids, hf_greedy(path, prompts[i], 6), f"{what}: request {i} vs transformers")
    assert_pool_free_after_tree(engine, what)


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_an_abort_in_flight_leaves_every_token_it_computed_in_the_tree(tiny_models_root, disable_overlap):
    """Under overlap the step in flight has written the K/V of the aborted request's newest real
    token (only the token it samples is dropped), so the tree gets all of its tokens; without
    overlap, as in stage 8, that token was never fed back and the tree gets all but it."""
    path = tiny_models_root / "llama"
    what = f"llama, abort, {'no ' if disable_overlap else ''}overlap"
    prompt = random_prompt(7, seed=11)
    engine = engine_on(path, disable_overlap=disable_overlap, pool_size=256, page_size=1)
    [req], _ = run_checked(engine, [prompt], [greedy(30)], what, aborts={4: [0]})
    tokens = prompt + req.output_ids
    computed = len(tokens) - (1 if disable_overlap else 0)
    assert req.finished_reason.type == "abort" and len(req.output_ids) < 30, f"{what}: test set-up: {req}"
    assert tree_paths(engine.tree_cache) == [tokens[:computed]], (
        f"{what}: the radix tree holds {[len(p) for p in tree_paths(engine.tree_cache)]} tokens after the abort, "
        f"expected the {computed} of its {len(tokens)} real tokens whose K/V were computed: an aborted request "
        "keeps all it computed (only a FINISHED one drops the position of the step it was scheduled for after its end)"
    )
    assert_pool_free_after_tree(engine, what)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_failed_forward_under_overlap_leaves_nothing_untrusted(tiny_models_root, page_size):
    """A forward raises while the next step is already built: step() raises, abort_failed_step ends
    every request and frees everything, no future id stays in a request, and the radix tree holds
    no K/V of the failed step (the same requests, continued, get transformers' tokens afterwards)."""
    path = tiny_models_root / "llama3"
    what = f"llama3, a failed forward, page_size={page_size}"
    engine = engine_on(path, pool_size=512, page_size=page_size)
    prompts = [random_prompt(n, seed=70 + n) for n in (9, 14, 5)]
    runner, real_forward, passes = engine.runner, engine.runner.forward, []

    def failing_forward(batch):
        passes.append(batch.num_reqs)
        if len(passes) == 4:
            raise RuntimeError("injected: the device failed")
        return real_forward(batch)

    runner.forward = failing_forward
    reqs = [engine.add_request(p, greedy(12)) for p in prompts]
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(10):
            engine.step()
    aborted = engine.abort_failed_step()
    assert {req.rid for req in aborted} == {req.rid for req in reqs}, (
        f"{what}: every request of the failed steps must end"
    )
    assert all(t >= 0 for req in reqs for t in req.output_ids), (
        f"{what}: a future id stayed: {[r.output_ids for r in reqs]}"
    )
    assert not engine.has_work
    engine.scheduler.check_invariants()
    assert_pool_free_after_tree(engine, what)
    runner.forward = real_forward
    # each request's tokens so far and one more: the tree's match covers the failed step's position
    prompts = [prompt + req.output_ids + [33] for prompt, req in zip(prompts, reqs)]
    again, _ = run_checked(engine, prompts, [greedy(6)] * 3, f"{what}, the same prompts again")
    for i, (req, prompt) in enumerate(zip(again, prompts)):
        assert_same_tokens(
            req.output_ids, hf_greedy(path, prompt, 6), f"{what}: request {i} after the failure vs transformers"
        )
