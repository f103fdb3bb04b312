"""Stage 5 (graded): continuous batching changes when tokens are computed, never which ones.

A batch of many requests with mixed prompt and output lengths, admitted a few at a time and
joining while others decode, must give every request exactly its single-request greedy tokens
(stage 3) and those of transformers."""

from __future__ import annotations

from continuous_helpers import assert_pool_free, greedy, tiny_engine, workload
from invariants import capped_steps
from reference import assert_same_tokens, engine_model, engine_tokenizer, hf_greedy
from s02_request_and_sampling.sampling_params import SamplingParams
from s03_kv_cache.generate import cached_generate
from s05_continuous_batching.engine import Engine


def test_many_mixed_requests_equal_single_request_and_transformers(tiny_model_dir):
    prompts, limits = workload(18, seed=5)
    engine, recorder, traces = tiny_engine(
        tiny_model_dir, pool_size=2048, max_running_requests=6, max_prefill_tokens=64
    )
    outputs = engine.generate(prompts, [greedy(n) for n in limits])
    model = engine_model(str(tiny_model_dir))
    for i, (prompt, n, out) in enumerate(zip(prompts, limits, outputs)):
        what = f"{tiny_model_dir.name}, request {i} ({len(prompt)}-token prompt, max_new_tokens={n}) of {len(prompts)}"
        assert_same_tokens(out.output_ids, hf_greedy(tiny_model_dir, prompt, n), f"{what}, vs transformers")
        assert_same_tokens(out.output_ids, cached_generate(model, prompt, n), f"{what}, vs stage 3 alone")
    sizes = [len(extend_lens) for extend_lens, _ in recorder.passes]
    assert max(sizes) > 1, (
        f"every forward pass ran a single request ({len(sizes)} passes): the requests must share passes"
    )
    assert max(sizes) <= 6, f"a pass ran {max(sizes)} requests, but max_running_requests=6"
    mixed = [e for e, p in recorder.passes if any(x > 1 for x in e) and any(q > 0 and x == 1 for x, q in zip(e, p))]
    assert mixed, (
        "no forward pass mixed a new request's prefill with running requests' decodes: waiting requests must be "
        "admitted as soon as there is room, not only when the running batch is empty (passes: "
        f"{recorder.passes[:8]}...)"
    )
    assert_pool_free(engine, tiny_model_dir.name)


def test_request_added_mid_decode_gets_the_same_tokens(tiny_models_root):
    path = tiny_models_root / "qwen2"
    engine, recorder, traces = tiny_engine(path, pool_size=1024, max_running_requests=8)
    requests = {
        "first": (list(b"The first request has a long way to go"), 20),
        "late-0": (list(b"late"), 9),
        "late-1": (list(b"a later, longer one!"), 12),
    }
    streamed = {rid: [] for rid in requests}
    finish = {}

    def step():
        for out in engine.step():
            streamed[out.rid] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.rid] = out.finish_reason
        engine.scheduler.check_invariants()

    first = requests["first"][0]
    engine.add_request(first, greedy(20), rid="first")
    for _ in range(5):
        step()
    passes_before = len(recorder.passes)
    for rid in ("late-0", "late-1"):
        engine.add_request(requests[rid][0], greedy(requests[rid][1]), rid=rid)
    step()
    extend_lens, prefix_lens = recorder.passes[passes_before]
    assert extend_lens == [1, 4, 20] and prefix_lens == [len(first) + 4, 0, 0], (
        "the step after two requests arrive while 'first' decodes should be ONE pass: 'first' decodes one token "
        f"(extend 1 after {len(first) + 4} cached) and the newcomers prefill (extend 4 and 20, nothing cached); "
        f"your pass had extend_lens={extend_lens}, prefix_lens={prefix_lens}"
    )
    for _ in capped_steps(engine):
        step()
    model = engine_model(str(path))
    for rid, (prompt, n) in requests.items():
        assert_same_tokens(
            streamed[rid], cached_generate(model, prompt, n), f"request {rid!r} (streamed by step()), vs alone"
        )
        assert_same_tokens(
            streamed[rid], hf_greedy(path, prompt, n), f"request {rid!r} (streamed by step()), vs transformers"
        )
        assert finish.get(rid) is not None and finish[rid].type == "length", (
            f"request {rid!r}: its last step output should carry finish reason 'length', got {finish.get(rid)}"
        )
    assert_pool_free(engine, "qwen2")


def test_default_model_continuous_batch_equals_transformers(default_model_dir):
    tok = engine_tokenizer(str(default_model_dir))
    questions = ["What is the capital of France?", "Hi!", "Name three colours.", "Count from one to five."]
    engine = Engine(engine_model(str(default_model_dir)), tok, pool_size=1024, page_size=4, max_running_requests=2)
    outputs = engine.generate(questions, SamplingParams(temperature=0, max_new_tokens=12))
    for i, (question, out) in enumerate(zip(questions, outputs)):
        expected = hf_greedy(default_model_dir, tok.encode_prompt(question), 12, tok.eos_token_ids)
        assert_same_tokens(out.output_ids, expected, f"SmolLM2, request {i} ({question!r}), two running at a time", tok)
    assert engine.scheduler.stats.peak_running == 2, (
        "with max_running_requests=2 and 4 requests, 2 should run together; the peak was "
        f"{engine.scheduler.stats.peak_running}"
    )
    assert_pool_free(engine, "SmolLM2")
