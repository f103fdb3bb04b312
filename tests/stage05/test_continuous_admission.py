"""Stage 5 (graded): admission - first come first served (nobody overtakes a head that does not
fit), within the prefill token budget, the request rows and the pool's room (keeping room for an
admitted request's own future tokens; its own cached prefix is not room) - and what the offline
API returns: outputs in input order, per-request stats, and a trace line per step."""

from __future__ import annotations

import re

from continuous_helpers import assert_pool_free, greedy, retraction_workload, run_to_end, tiny_engine, workload
from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool.model_runner import ModelRunner
from s05_continuous_batching.engine import Engine
from s05_continuous_batching.prefix_cache import PrefixMatch
from s05_continuous_batching.scheduler import Scheduler


def test_admission_is_fcfs_within_the_prefill_budget_and_row_limit(tiny_models_root):
    path = tiny_models_root / "qwen3"
    prompts, limits = workload(14, seed=21, max_prompt=40, max_new=10)
    budget, rows = 50, 4
    engine, recorder, traces = tiny_engine(path, pool_size=2048, max_running_requests=rows, max_prefill_tokens=budget)
    for p, n in zip(prompts, limits):
        engine.add_request(p, greedy(n))
    run_to_end(engine)
    admitted_order, next_in_line = [], 0
    for trace, (extend_lens, _) in zip(traces, recorder.passes):
        new = trace.prefill_rids
        assert extend_lens[len(trace.decode_rids) :] == [len(prompts[rid]) for rid in new], (
            f"step {trace.step}: the pass's prefill rows should send the whole prompts of {new} "
            f"({[len(prompts[rid]) for rid in new]} tokens), they sent {extend_lens[len(trace.decode_rids) :]}"
        )
        assert len(trace.decode_rids) + len(new) <= rows, (
            f"step {trace.step}: {len(trace.decode_rids)} running + {len(new)} admitted requests, "
            f"max_running_requests={rows}"
        )
        tokens = sum(len(prompts[rid]) for rid in new)
        assert tokens <= budget or len(new) == 1, (
            f"step {trace.step}: admitted {new} with {tokens} prompt tokens in total, over "
            f"max_prefill_tokens={budget}; "
            "only a single request may exceed the budget (as the only prefill of its step)"
        )
        admitted_order += new
        next_in_line += len(new)
        if next_in_line < len(prompts):  # the next one in line was not admitted: a budget must have stopped it
            head = next_in_line
            full = len(trace.decode_rids) + len(new) == rows
            over = tokens + len(prompts[head]) > budget and new
            assert full or over, (
                f"step {trace.step}: request {head} ({len(prompts[head])} tokens) waited although a row was free and "
                "it fit the "
                f"prefill budget ({tokens} of {budget} used by {new}); admit waiting requests while the budgets allow"
            )
    assert admitted_order == list(range(len(prompts))), (
        f"requests must be admitted first come first served (0, 1, 2, ...); the order was {admitted_order}"
    )
    assert_pool_free(engine, "FCFS workload")


def test_a_prompt_longer_than_the_prefill_budget_is_the_only_prefill_of_its_step(tiny_models_root):
    path = tiny_models_root / "llama"
    long_prompt, short = list(b"x" * 20 + b"a prompt longer than the budget of 32 tokens"), list(b"short")
    engine, recorder, traces = tiny_engine(path, pool_size=512, max_running_requests=4, max_prefill_tokens=32)
    outputs = engine.generate([short, long_prompt, short], [greedy(6), greedy(6), greedy(6)])
    for i, prompt in enumerate([short, long_prompt, short]):
        assert_same_tokens(
            outputs[i].output_ids, hf_greedy(path, prompt, 6), f"request {i} ({len(prompt)} tokens), vs transformers"
        )
    long_steps = [t for t in traces if 1 in t.prefill_rids]
    assert long_steps and long_steps[0].prefill_rids == [1], (
        f"the {len(long_prompt)}-token prompt is over max_prefill_tokens=32: it must be admitted as the only prefill "
        "of "
        f"its step; steps with it: {[(t.step, t.prefill_rids) for t in long_steps]}"
    )
    assert long_steps[0].decode_rids == [0], (
        f"request 0 was running when the long prompt was admitted: its decode rides in the same pass (only the "
        f"prefills are rationed); that step decoded {long_steps[0].decode_rids}"
    )
    assert_pool_free(engine, "long prompt")


def test_prompts_that_exactly_fill_the_prefill_budget_are_admitted_together(tiny_models_root):
    path = tiny_models_root / "llama"
    engine, _, traces = tiny_engine(path, pool_size=512, max_running_requests=4, max_prefill_tokens=10)
    engine.generate([list(b"four"), list(b"six ok"), list(b"x")], [greedy(2), greedy(2), greedy(2)])
    assert traces[0].prefill_rids == [0, 1], (
        "max_prefill_tokens=10 and prompts of 4 and 6 tokens: together they fill the budget exactly, so both are "
        f"admitted in the first step (a prompt is refused only when it needs more than what is left); the first step "
        f"admitted {traces[0].prefill_rids}"
    )


def test_outputs_come_back_in_input_order_with_stats(tiny_models_root):
    path = tiny_models_root / "llama3"
    prompts, _ = workload(6, seed=4, max_prompt=20)
    limits = [14, 12, 10, 8, 3, 1]  # later requests finish first
    engine, _, traces = tiny_engine(path, pool_size=512, max_running_requests=3)
    outputs = engine.generate(prompts, [greedy(n) for n in limits])
    assert len(outputs) == len(prompts), f"{len(prompts)} prompts but {len(outputs)} outputs"
    finish_order = [rid for t in traces for rid in t.finished_rids]
    assert finish_order != sorted(finish_order), (
        f"this workload should finish out of order, finished {finish_order}: each step's trace lists the finished "
        "requests among those process_batch_result returns, which are all the requests that got a token, the "
        "finished ones included"
    )
    for i, (prompt, n, out) in enumerate(zip(prompts, limits, outputs)):
        assert_same_tokens(
            out.output_ids, hf_greedy(path, prompt, n), f"output {i} (outputs must follow the prompts' order)"
        )
        assert (out.prompt_tokens, out.output_tokens) == (len(prompt), n), (
            f"output {i}: prompt_tokens={out.prompt_tokens}, output_tokens={out.output_tokens}; expected "
            f"{len(prompt)} and {n}"
        )
        assert out.finish_reason.type == "length", f"output {i}: finish reason {out.finish_reason}, expected 'length'"
        assert out.ttft is not None and out.latency is not None and 0 < out.ttft <= out.latency, (
            f"output {i}: need 0 < ttft <= latency, got ttft={out.ttft}, latency={out.latency}"
        )
    # Requests 3-5 wait for a row (max_running_requests=3): their first token comes after the first request's.
    assert min(out.ttft for out in outputs[3:]) > outputs[0].ttft, (
        f"requests that had to wait should have a later first token; ttfts: {[round(o.ttft, 4) for o in outputs]}"
    )
    assert_pool_free(engine, "input order")


LINE = re.compile(
    r"prefill\s+(\d+) reqs\s+(\d+) tok \| decode\s+(\d+) \| running\s+(\d+) waiting\s+(\d+) \| free KV\s+(\d+)/(\d+)"
)


def test_trace_prints_one_line_per_step(tiny_models_root, capsys):
    path = tiny_models_root / "qwen2"
    prompts, limits = workload(6, seed=9, max_prompt=24, max_new=8)
    engine = Engine(
        engine_model(str(path)), engine_tokenizer(str(path)), pool_size=256, max_running_requests=3, trace=True
    )
    capsys.readouterr()
    engine.generate(prompts, [greedy(n) for n in limits])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    steps = engine.scheduler.stats.steps
    assert steps > 0 and len(lines) == steps, (
        f"trace=True should print one line per step: {steps} steps, {len(lines)} lines"
    )
    parsed = [LINE.search(line) for line in lines]
    assert all(parsed), (
        "a trace line should read like 'prefill 2 reqs 87 tok | decode 5 | running 7 waiting 3 | free KV 120/512'; "
        f"got {lines[0]!r}"
    )
    first = [int(x) for x in parsed[0].groups()]
    assert first[:3] == [3, sum(len(p) for p in prompts[:3]), 0] and first[3:5] == [
        3 - sum(n == 1 for n in limits[:3]),
        3,
    ], (
        f"the first step admits 3 requests ({sum(len(p) for p in prompts[:3])} prompt tokens), decodes none, and "
        "leaves "
        f"3 waiting; its line was {lines[0]!r}"
    )
    last = [int(x) for x in parsed[-1].groups()]
    assert last[3:] == [0, 0, 256, 256], (
        f"after the last step nothing runs or waits and all 256 slots are free: {lines[-1]!r}"
    )
    admitted = sum(int(m.group(1)) for m in parsed)
    assert admitted == len(prompts), (
        f"the lines' prefill counts add up to {admitted} admissions for {len(prompts)} requests"
    )


def queue_and_admit(scheduler, reqs) -> list:
    """Queue ``reqs`` and run one admission; returns the admitted requests' ids."""
    for req in reqs:
        scheduler.add_request(req)
    return [req.rid for req in scheduler.admit_new_requests()]


def admit_only_the_first(scheduler, reqs, why: str) -> None:
    """Queue ``reqs`` and run one admission: only the first may be admitted (``why`` says why)."""
    __tracebackhide__ = True
    admitted = queue_and_admit(scheduler, reqs)
    assert admitted == [reqs[0].rid], f"admitted {admitted}, expected only request {reqs[0].rid}{why}"
    waiting = [req.rid for req in scheduler.waiting]
    assert waiting == [req.rid for req in reqs[1:]], f"the others should still wait in order, the queue is {waiting}"


def test_admission_after_requests_already_in_the_pass_returns_only_those_it_started(tiny_models_root):
    # Stage 7 calls admission with its half-prefilled request already in the pass (``scheduled``):
    # that request takes one of the step's rows, and the caller puts it in the batch itself.
    model = engine_model(str(tiny_models_root / "llama"))
    runner = ModelRunner(model, pool_size=512, max_running_requests=3, max_context_len=128)
    scheduler = Scheduler(runner)
    scheduler.add_request(Req(0, list(b"already in this pass"), greedy(2)))
    [scheduled] = scheduler.admit_new_requests()
    for rid in (1, 2, 3):
        scheduler.add_request(Req(rid, list(b"waiting %d" % rid), greedy(2)))
    admitted = [req.rid for req in scheduler.admit_new_requests(scheduled=[scheduled])]
    assert admitted == [1, 2], (
        "with request 0 already in this pass (scheduled=[request 0]) and max_running_requests=3, admission starts "
        "requests 1 and 2 (request 0 takes the third row) and returns only those: the caller already has the "
        f"scheduled ones, and would run them twice; it returned {admitted}"
    )


class OnePrefixCache:
    """A stand-in prefix cache holding the K/V of one prefix, in slots it owns and no request
    uses: room admission may count (evictable) - except for a request that reads those very
    slots, which locks them (stage 6's radix tree behaves the same way)."""

    def __init__(self, allocator, prefix: list[int]):
        self.prefix = prefix
        self.slots = allocator.alloc_extend([0], [len(prefix)], [0])
        self.locks = 0

    def match_prefix(self, token_ids):
        if list(token_ids[: len(self.prefix)]) == self.prefix:
            return PrefixMatch(len(self.prefix), self.slots, node="the prefix")
        return PrefixMatch(0, self.slots[:0])

    def lock(self, match):
        self.locks += match.node is not None

    def unlock(self, match):
        self.locks -= match.node is not None

    def evictable_size(self) -> int:
        return 0 if self.locks else len(self.prefix)


def test_admission_keeps_back_what_the_requests_admitted_before_need(tiny_models_root):
    # Pool of 64 slots, nothing cached, new_token_ratio=0: request 0's prompt takes 40 slots,
    # leaving 24; request 1 needs 30 and must wait, though the pool alone has 64 free.
    model = engine_model(str(tiny_models_root / "llama"))
    runner = ModelRunner(model, pool_size=64, max_running_requests=4, max_context_len=128)
    admit_only_the_first(
        Scheduler(runner, new_token_ratio=0.0),
        [Req(0, list(b"a" * 40), greedy(1)), Req(1, list(b"b" * 30), greedy(1))],
        (
            ": request 0, admitted first, takes 40 of the 64 slots in this very pass, leaving 24, and request 1 needs "
            "30. Nothing is allocated until the pass runs, so the room is available_slots() minus what admission "
            "keeps back (reserved: the next pass and future of the running requests, plus the need of each request "
            "admitted before in this step)"
        ),
    )


def test_admission_does_not_count_a_requests_own_cached_prefix_as_room(tiny_models_root):
    # Pool of 80 slots; the cache holds a 16-token prefix (free: 64, evictable: 16).
    # Request 0 (8 tokens, nothing cached) is admitted first. Request 1 is that prefix plus 60
    # new tokens: it needs 60 fresh slots. The room is 64 free - 8 kept for request 0 = 56, plus
    # the 16 evictable slots only if request 1 itself did not read them. It does: it must wait.
    model = engine_model(str(tiny_models_root / "llama"))
    runner = ModelRunner(model, pool_size=80, max_running_requests=4, max_context_len=128)
    prefix = list(range(40, 56))
    cache = OnePrefixCache(runner.allocator, prefix)
    scheduler = Scheduler(runner, prefix_cache=cache, new_token_ratio=0.0)
    admit_only_the_first(
        scheduler,
        [Req(0, list(b"no match"), greedy(2)), Req(1, prefix + [60 + i % 40 for i in range(60)], greedy(1))],
        (
            ": request 1 needs 60 fresh slots and the room is 56 (64 free - 8 kept for request 0). Its own cached "
            "prefix "
            "(16 evictable slots) is not room it could evict for itself: count the room while its match is locked "
            "(prefix_cache.lock / unlock around the check)"
        ),
    )
    assert cache.locks == 0, (
        f"the cached prefix is still locked {cache.locks} time(s), but no admitted request reads it: "
        "undo the lock taken to measure the room (unlock) whether or not the request is admitted"
    )


def test_admission_counts_what_the_prefix_cache_could_evict_as_room(tiny_models_root):
    # Pool of 80 slots; the cache holds a 16-token prefix no request here reads (free: 64,
    # evictable: 16). Request 0 (8 tokens) is admitted first; request 1 (60 tokens, no match)
    # needs 60 fresh slots. The room is 64 free + 16 evictable - 8 kept for request 0 = 72: it fits.
    model = engine_model(str(tiny_models_root / "llama"))
    runner = ModelRunner(model, pool_size=80, max_running_requests=4, max_context_len=128)
    cache = OnePrefixCache(runner.allocator, list(range(40, 56)))
    scheduler = Scheduler(runner, prefix_cache=cache, new_token_ratio=0.0)
    admitted = queue_and_admit(
        scheduler, [Req(0, list(b"no match"), greedy(2)), Req(1, [60 + i % 40 for i in range(60)], greedy(1))]
    )
    assert admitted == [0, 1], (
        f"admitted {admitted}, expected [0, 1]: request 1 needs 60 fresh slots, and the room is 72 (64 free + 16 the "
        "prefix cache holds for nobody, which it gives back on demand, - 8 kept for request 0). Count the room from "
        "available_slots() (free slots plus prefix_cache.evictable_size()), not from the allocator's free slots "
        "alone: otherwise a pool full of cached K/V admits nobody"
    )


def scheduler_with_one_prefix(tiny_models_root):
    """A scheduler (pool of 80 slots) whose stand-in cache holds one 16-token prefix, and that prefix."""
    model = engine_model(str(tiny_models_root / "llama"))
    runner = ModelRunner(model, pool_size=80, max_running_requests=4, max_context_len=128)
    prefix = list(range(40, 56))
    return Scheduler(runner, prefix_cache=OnePrefixCache(runner.allocator, prefix)), prefix


def test_a_prompt_the_cache_holds_whole_still_computes_its_last_token(tiny_models_root):
    # The cache holds a 16-token prefix and the prompt IS that prefix. Its first output token comes
    # from the logits at its last prompt token, so at least that token must be computed: the match
    # is looked up for all tokens but the last (the stand-in cache then matches nothing).
    scheduler, prefix = scheduler_with_one_prefix(tiny_models_root)
    scheduler.add_request(Req(0, list(prefix), greedy(2)))
    [req] = scheduler.admit_new_requests()
    computed = req.device_len - req.cached_len
    assert computed >= 1, (
        f"a prompt of {len(prefix)} tokens, all of them cached, was admitted to compute {computed} tokens "
        f"(cached_len {req.cached_len}, device_len {req.device_len}): its last token must always be computed, "
        "since its logits give the first output token. Match the prefix of fill_ids[: req.max_prefix_len] (all but "
        "the last token), not of the whole prompt"
    )


def test_a_request_scoring_its_prompt_takes_no_unscored_prefix(tiny_models_root):
    # The same cached prefix and two prompts that start with it: the one asking for prompt_logprobs
    # needs the logits at every prompt position, which a cached prefix does not have, so it
    # takes nothing from the cache (req.max_prefix_len is 0: it has scored nothing yet).
    scheduler, prefix = scheduler_with_one_prefix(tiny_models_root)
    scoring = SamplingParams(temperature=0, max_new_tokens=2, prompt_logprobs=1)
    scheduler.add_request(Req(0, prefix + [70, 71], greedy(2)))
    scheduler.add_request(Req(1, prefix + [80, 81], scoring))
    plain, scored = scheduler.admit_new_requests()
    assert plain.cached_len == len(prefix), (
        f"request 0 starts with the cached {len(prefix)}-token prefix and should take it (cached_len "
        f"{plain.cached_len})"
    )
    assert scored.cached_len == 0, (
        f"request 1 asked for prompt_logprobs and took {scored.cached_len} prompt tokens from the cache: cached "
        "positions have no logits to score. Match the prefix of fill_ids[: req.max_prefix_len] (here 0 tokens)"
    )


def test_a_request_whose_future_does_not_fit_waits_while_another_runs(tiny_models_root):
    # Pool of 64 slots, new_token_ratio=1: request 0 (8 prompt tokens, 8 new) keeps 8 + 7 = 15 slots,
    # leaving 49. Request 1's prompt (20 tokens) fits in 49, but with the 30 tokens it may still
    # generate after its first it needs 50: admitted now, it would run short later.
    model = engine_model(str(tiny_models_root / "llama"))
    runner = ModelRunner(model, pool_size=64, max_running_requests=4, max_context_len=128)
    scheduler = Scheduler(runner, new_token_ratio=1.0)
    admit_only_the_first(
        scheduler,
        [Req(0, list(b"8 tokens"), greedy(8)), Req(1, list(b"x" * 20), greedy(31))],
        (
            ". With new_token_ratio=1, request 0 keeps 15 slots (8 for its prompt, 7 for its future tokens), leaving "
            "49 of "
            "64. Request 1's prefill (20 slots) fits, but with the 30 future tokens it may still generate it needs 50: "
            "admission must keep room for an admitted request's own future too (need = prefill slots + "
            "future_slots(req)), "
            "or it runs short later. Only the first request of a step in which nothing runs is admitted on its prefill "
            "alone (request 0 here, admitted in the same step: request 1 is not that first one)"
        ),
    )


class FivePerPass(Scheduler):
    """A scheduler whose first passes compute at most 5 tokens (stage 7 cuts long prompts so)."""

    def prefill_len(self, req: Req, cached_len: int, budget: int) -> int:
        return min(super().prefill_len(req, cached_len, budget), 5)


def test_admission_gives_a_request_the_pass_prefill_len_chose(tiny_models_root):
    # Pool of 64 slots, new_token_ratio=1, first passes of at most 5 tokens. Request 0 (4 tokens,
    # 2 new) keeps 4 + 1 slots. Request 1's whole 60-token prompt would not fit the 59 left, but
    # its first pass (5 tokens) does: admission counts, and sets device_len to, the pass it chose.
    model = engine_model(str(tiny_models_root / "llama"))
    runner = ModelRunner(model, pool_size=64, max_running_requests=4, max_context_len=128)
    scheduler = FivePerPass(runner, new_token_ratio=1.0)
    reqs = [Req(0, list(b"four"), greedy(2)), Req(1, list(b"y" * 60), greedy(1))]
    admitted = queue_and_admit(scheduler, reqs)
    assert admitted == [0, 1], (
        f"admitted {admitted}: request 1's first pass is 5 tokens (self.prefill_len, which this test's scheduler "
        "caps at 5), and 5 slots fit the 59 left after request 0; count a new request's prefill from the pass "
        "prefill_len gives it, not from its whole prompt"
    )
    ends = [req.device_len for req in reqs]
    assert ends == [4, 5], (
        f"the admitted requests' device_len is {ends}, their passes end at [4, 5] (cached_len + prefill_len): "
        "admission sets req.device_len to the end of the pass it chose, which is what the pass sends "
        "(fill_ids[cached_len:device_len]); from stage 7 on that end is short of the prompt's"
    )


def test_a_request_that_needs_exactly_the_room_left_is_admitted(tiny_models_root):
    # new_token_ratio=1: request 0 (8 tokens, 2 new) needs 8 + 1 slots; request 1 (1 new token, no
    # future) is made exactly as long as the room then left, so it fits; request 2 then finds none.
    model = engine_model(str(tiny_models_root / "llama"))
    runner = ModelRunner(model, pool_size=32, max_running_requests=4, max_context_len=128)
    scheduler = Scheduler(runner, new_token_ratio=1.0)
    room = scheduler.available_slots() - 9
    admitted = queue_and_admit(
        scheduler, [Req(0, list(b"8 tokens"), greedy(2)), Req(1, list(b"z" * room), greedy(1)), Req(2, [7], greedy(1))]
    )
    assert admitted == [0, 1], (
        f"admitted {admitted}, expected [0, 1]: after request 0 (9 slots with its future) {room} slots are left, "
        f"and request 1 needs exactly {room} (its prompt; no future at max_new_tokens=1). A request fits when its "
        "need is at most the room (need <= room); request 2 then needs 1 slot of 0 and waits"
    )


def test_with_a_ratio_of_1_nothing_admitted_ever_runs_short(tiny_models_root):
    """The scheduler's promise: new_token_ratio=1 keeps back everything an admitted request may
    still need, so no request is ever retracted - on pools that retract at a ratio of 0."""
    path = tiny_models_root / "llama3"
    mixed = retraction_workload()
    # 16-token prompts, 2 new tokens each: every request needs a second page of 16 for its last position.
    one_page_prompts = ([list(bytes([65 + i]) * 16) for i in range(5)], [2] * 5)
    for (prompts, limits), pool, page_size in ((mixed, 128, 1), (one_page_prompts, 64, 16)):
        what = f"a {pool}-slot pool in pages of {page_size}, {len(prompts)} requests"
        counts = {}
        for ratio in (0.0, 1.0):
            engine, _, _ = tiny_engine(
                path, pool_size=pool, page_size=page_size, max_running_requests=8, new_token_ratio=ratio
            )
            reqs = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, limits)]
            run_to_end(engine)
            counts[ratio] = engine.scheduler.stats.num_retractions
            for i, (req, prompt, n) in enumerate(zip(reqs, prompts, limits)):
                assert_same_tokens(
                    req.output_ids,
                    hf_greedy(path, prompt, n),
                    f"{what}, new_token_ratio={ratio}: request {i}, vs transformers",
                )
            assert_pool_free(engine, f"{what}, new_token_ratio={ratio}")
        assert counts[0.0] > 0, (
            f"{what}: at new_token_ratio=0 the running requests must outgrow the pool, yet nothing was retracted"
        )
        assert counts[1.0] == 0, (
            f"{what}: with new_token_ratio=1 admission keeps room for every admitted request's remaining tokens, so "
            "nothing "
            f"admitted can ever run short; yet {counts[1.0]} retraction(s) happened. Admission must count an admitted "
            "request's own future (need = prefill slots + future_slots(req), in whole pages), not only its prefill; "
            "the one exception, a first request admitted on its prefill alone, is only for a step in which nothing "
            "runs"
        )


def test_a_head_that_does_not_fit_is_not_overtaken(tiny_models_root):
    # Pool of 64, new_token_ratio=0: request 0 (40 tokens) runs; request 1 (30 tokens) does not fit the
    # 24 slots left; request 2 (5 tokens) would fit, but it came after request 1: first come, first served.
    path = tiny_models_root / "qwen2"
    prompts = [list(b"a" * 40), list(b"b" * 30), list(b"c" * 5)]
    engine, _, traces = tiny_engine(path, pool_size=64, max_running_requests=4, new_token_ratio=0.0)
    reqs = [engine.add_request(p, greedy(4)) for p in prompts]
    run_to_end(engine)
    first_admission = []
    for trace in traces:
        first_admission += [rid for rid in trace.prefill_rids if rid not in first_admission]
    for k, rid in enumerate(first_admission):
        earlier = [other for other in range(rid) if other not in first_admission[:k]]
        assert not earlier, (
            f"request {rid} overtook request {earlier[0]}: {earlier[0]} was first in line and did not fit the pool, "
            "and a "
            f"later request was admitted before it (admission order {first_admission}). The first request that does "
            "not "
            "fit stops admission (first come, first served): nobody overtakes it, so nobody starves"
        )
    for i, (req, prompt) in enumerate(zip(reqs, prompts)):
        assert_same_tokens(
            req.output_ids, hf_greedy(path, prompt, 4), f"request {i} ({len(prompt)}-token prompt), vs transformers"
        )
    assert_pool_free(engine, "a head that does not fit")
