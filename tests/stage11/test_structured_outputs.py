"""Stage 11 (graded): every constrained output follows its grammar.

Batches that mix JSON schemas (nested objects, arrays of enums, bounded numbers, optional fields,
string patterns), regexes and free requests, greedy and seeded, with overlap on and off: every
constrained output ends by itself and parses and validates (``jsonschema``, ``re.fullmatch``);
both loops give the same tokens; an object's properties come in the schema's order; greedy
constrained tokens equal transformers' ``generate`` with a logits processor made from the same
library (llguidance); the bitmask masks exactly the forbidden tokens; retraction rolls the grammar
back and changes nothing; an abort frees the grammar."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from invariants import check_all
from penalty_cases import assert_penalties_like_stage3, penalised_params
from reference import assert_logprobs_match, hf_model
from s02_request_and_sampling.sampling_params import SamplingParams
from s11_structured_output.grammar_backend import GrammarBackend
from s11_structured_output.sampling_params import GrammarKey, canonical_schema
from s11_structured_output.vocab_mask import apply_token_bitmask
from structured_helpers import (
    REGEXES,
    SCHEMAS,
    assert_follows,
    check_every_step,
    constrained,
    engine_on,
    mixed_workload,
)


def test_the_bitmask_masks_exactly_the_forbidden_tokens():
    gen = torch.Generator().manual_seed(0)
    words, vocab = 2, 70  # 64 tokens in the mask; the logits have 6 columns of padding past them
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.clone()
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little").reshape(3, -1).astype(bool)
    allowed = np.zeros((3, vocab), dtype=bool)
    allowed[:, : 32 * words] = bits
    expected[~torch.from_numpy(allowed)] = float("-inf")
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected), (
        "apply_token_bitmask: bit j of word w allows token 32*w + j; every other logit (and every column "
        "past the mask's tokens) must become -inf, the allowed ones unchanged"
    )


@pytest.fixture(scope="module")
def tiny_llama(tiny_models_root):
    return tiny_models_root / "llama"


@pytest.fixture(scope="module")
def outputs_by_mode(tiny_llama):
    """The workload run on one engine per loop (overlap on, then off)."""
    prompts, params, specs = mixed_workload()
    results = {}
    for disable_overlap in (False, True):
        engine = engine_on(tiny_llama, disable_overlap=disable_overlap, pool_size=2048)
        check_every_step(engine, f"the workload, {'no overlap' if disable_overlap else 'overlap'}")
        results[disable_overlap] = engine, engine.generate(prompts, params)
    return results, specs


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_every_constrained_output_follows_its_grammar(outputs_by_mode, disable_overlap):
    results, specs = outputs_by_mode
    engine, outputs = results[disable_overlap]
    mode = "no overlap" if disable_overlap else "overlap"
    for out, spec in zip(outputs, specs):
        if spec is None:
            assert len(out.output_ids) == 6, f"{mode}: a free request in the batch should run as usual: {out}"
            continue
        kind, grammar, name = spec
        assert_follows(out.text, out.finish_reason, kind, grammar, f"{mode}, {kind} {name}")
    check_all(engine, mode)


def test_both_loops_give_the_same_tokens(outputs_by_mode):
    results, specs = outputs_by_mode
    for i, (on, off) in enumerate(zip(results[False][1], results[True][1])):
        assert on.output_ids == off.output_ids, (
            f"request {i} ({specs[i][2] if specs[i] else 'free'}): overlap on gave {on.output_ids}, off gave "
            f"{off.output_ids}; a grammar must see each token before the next mask, in both loops"
        )


def test_each_schema_compiles_once(outputs_by_mode, tiny_llama):
    results, _ = outputs_by_mode
    engine = results[False][0]
    backend = engine.scheduler.grammar_backend
    distinct = len(SCHEMAS) + len(REGEXES)
    assert backend.compilations == distinct, (
        f"{distinct} distinct grammars were compiled {backend.compilations} times: the cache is keyed by (kind, text)"
    )
    # The same schema again, as indented JSON text: served from the cache.
    schema = SCHEMAS["flat"]
    respelled = json.dumps(schema, indent=4)
    [out] = engine.generate([[41, 42]], constrained("json", respelled))
    assert_follows(out.text, out.finish_reason, "json", schema, "the flat schema again")
    assert backend.compilations == distinct, (
        f"the flat schema, seen before, was compiled again ({backend.compilations} compilations for {distinct} "
        "distinct grammars): the cache is keyed by (kind, canonical text), so the same schema spaced "
        "another way hits it"
    )


def test_properties_come_in_the_schemas_order(outputs_by_mode):
    engine = outputs_by_mode[0][False][0]
    schema = SCHEMAS["flat"]
    reordered = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    outputs = engine.generate([[41, 42], [41, 42]], [constrained("json", schema), constrained("json", reordered)])
    for out, spec in zip(outputs, (schema, reordered)):
        assert_follows(out.text, out.finish_reason, "json", spec, "the flat schema")
        keys, expected = list(json.loads(out.text)), list(spec["properties"])
        assert keys == expected, (
            f"the schema lists the properties as {expected}, the output wrote {keys} ({out.text!r}): a grammar "
            "writes them in the schema's order, as OpenAI's structured outputs do; canonical_schema must keep "
            "the key order (json.dumps without sort_keys)"
        )


class LLGuidanceProcessor:
    """transformers' side of the comparison: the same library's matcher, masking the logits of
    each ``generate`` step (its own bit unpacking, with numpy)."""

    def __init__(self, backend: GrammarBackend, key: GrammarKey, prompt_len: int):
        self.grammar = backend.new_grammar(backend.get(key).result())
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            self.grammar.matcher.consume_token(int(input_ids[0, -1]))
        words = (scores.shape[1] + 31) // 32
        bitmask = torch.zeros(1, words, dtype=torch.int32)
        self.grammar.fill_mask(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: scores.shape[1]].astype(bool)
        return scores.masked_fill(~torch.from_numpy(bits)[None], float("-inf"))


@pytest.mark.parametrize("kind,name", [("json", "nested"), ("json", "array_enum"), ("regex", 1)])
def test_greedy_tokens_equal_transformers_with_the_same_grammar(outputs_by_mode, tiny_llama, kind, name):
    engine = outputs_by_mode[0][False][0]
    spec = SCHEMAS[name] if kind == "json" else REGEXES[name]
    text = canonical_schema(spec) if kind == "json" else spec
    assert kind in ("json", "regex")
    prompt = [65, 66, 67, 68]
    [out] = engine.generate([prompt], constrained(kind, spec))
    processor = LLGuidanceProcessor(engine.scheduler.grammar_backend, (kind, text), len(prompt))
    eos = sorted(engine.model.config.eos_token_ids)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf = (
            hf_model(str(tiny_llama))
            .generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=60,
                logits_processor=[processor],
                eos_token_id=eos,
                pad_token_id=eos[0],
            )[0, len(prompt) :]
            .tolist()
        )
    assert out.output_ids == hf, (
        f"{kind} {name}: the engine's constrained greedy tokens {out.output_ids} differ from transformers' with "
        f"the same grammar {hf}: the mask must be applied to the logits before sampling, and the grammar must "
        "consume every sampled token"
    )


def test_retraction_rolls_the_grammar_back_and_changes_nothing(outputs_by_mode, tiny_llama):
    prompts, params, _ = mixed_workload()
    engine = engine_on(tiny_llama, pool_size=72, max_running_requests=6, new_token_ratio=0.0)
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.stats.num_retractions > 0, "the pool was meant to be too small: nothing was retracted"
    for i, (got, want) in enumerate(zip(outputs, outputs_by_mode[0][False][1])):
        assert got.output_ids == want.output_ids, (
            f"request {i}: retracted and readmitted, it produced {got.output_ids} instead of {want.output_ids}; "
            "a retracted request keeps its tokens and its grammar at exactly those (release_req rolls it back to "
            "len(output_ids), and does not drop it)"
        )
    check_all(engine, "after retractions")


def test_rollback_to_returns_the_grammar_to_the_kept_tokens(outputs_by_mode):
    engine = outputs_by_mode[0][False][0]
    backend = engine.scheduler.grammar_backend
    key: GrammarKey = ("regex", REGEXES[1])
    text = "Abcde-1234"
    tokens = engine.tokenizer.hf(text, add_special_tokens=False)["input_ids"]
    grammar = backend.new_grammar(backend.get(key).result())
    for token in tokens:
        grammar.accept_token(token)
    grammar.rollback_to(3)
    fresh = backend.new_grammar(backend.get(key).result())
    for token in tokens[:3]:
        fresh.accept_token(token)
    masks = torch.zeros(2, (engine.model.config.vocab_size + 31) // 32, dtype=torch.int32)
    grammar.fill_mask(masks, 0)
    fresh.fill_mask(masks, 1)
    assert grammar.num_tokens == 3 and torch.equal(masks[0], masks[1]), (
        f"after consuming {len(tokens)} tokens and rollback_to(3), the grammar should be where one that consumed "
        f"only the first 3 is (num_tokens {grammar.num_tokens}, masks equal: {torch.equal(masks[0], masks[1])})"
    )


def test_abort_frees_the_grammar(tiny_llama):
    engine = engine_on(tiny_llama, pool_size=512)
    a = engine.add_request([80, 81], constrained("json", SCHEMAS["nested"]))
    b = engine.add_request([82, 83], constrained("regex", REGEXES[2]))
    with torch.inference_mode():
        while not a.grammar or len(a.output_ids) < 3:
            engine.step()
    assert engine.abort_request(a.rid) and engine.abort_request(b.rid)
    with torch.inference_mode():
        while engine.has_work:
            engine.step()
    for req in (a, b):
        assert req.finished_reason.type == "abort" and req.grammar is None, (
            f"request {req.rid}: aborted, it should end with 'abort' and drop its grammar; "
            f"got {req.finished_reason}, grammar {req.grammar}"
        )
    check_all(engine, "after aborts")


def test_a_finished_request_drops_its_grammar(tiny_llama):
    engine = engine_on(tiny_llama, pool_size=512)
    req = engine.add_request([84, 85], constrained("regex", REGEXES[0]))
    with torch.inference_mode():
        while engine.has_work:
            engine.step()
    assert req.finished_reason.type == "stop" and req.grammar is None, (
        f"request {req.rid} ended ({req.finished_reason}) but still holds its grammar ({req.grammar}): any request "
        "that leaves for good, finished as well as aborted, drops its matcher (release_req); only a retracted "
        "one keeps it"
    )


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_logprobs_are_the_models_own_before_the_mask(tiny_llama, disable_overlap):
    """A constrained request's logprobs describe the model's distribution, not the masked one: they
    equal transformers' unmasked log_softmax, so a token the grammar forced shows how unlikely the
    model found it (the mask works on a copy of the logits, after the logprobs are read)."""
    engine = engine_on(tiny_llama, disable_overlap=disable_overlap, pool_size=2048)
    prompts = [[40, 50, 60], [70, 33], [90, 91, 92]]
    params = [
        replace(constrained("json", SCHEMAS["flat"]), logprobs=2),
        replace(constrained("regex", REGEXES[1], temperature=1.0, seed=5), logprobs=1),
        SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=0),
    ]
    outputs = engine.generate(prompts, params)
    steered = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        try:
            assert_logprobs_match(
                tiny_llama, prompt, out, params[i].logprobs, f"request {i} of a mixed constrained batch"
            )
        except AssertionError as error:
            raise AssertionError(
                f"{error}\n(the mask must work on a float32 COPY of the logits: the log-probabilities are read from "
                "the caller's logits after sampling, and .float() of float32 logits is the same tensor)"
            ) from None
        steered += sum(bool(e.top) and e.top[0][0] != e.token_id for e in out.logprobs or [])
    assert_follows(outputs[0].text, outputs[0].finish_reason, "json", SCHEMAS["flat"], "the flat schema")
    assert steered > 0, "the grammar forced no token away from the model's own choice: the test shows nothing"
    check_all(engine, "after a constrained batch with logprobs")


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "no-overlap"])
def test_penalties_reshape_the_allowed_tokens_and_never_unmask(tiny_llama, disable_overlap):
    """The grammar's mask wins over any penalty or bias (a forbidden token's -inf stays -inf
    whatever is added or multiplied): a +100 bias on a forbidden token cannot bring it back, a -100 bias on
    allowed ones keeps them out, and the free requests of the batch get stage 3's penalised tokens."""
    engine = engine_on(tiny_llama, disable_overlap=disable_overlap, pool_size=2048)
    regex, allowed = r"[0-9]{6}", set("789")
    bias = {ord("x"): 100.0, **{ord(c): -100.0 for c in "0123456"}}
    params = [
        replace(constrained("regex", regex), logit_bias=bias, frequency_penalty=2.0),
        replace(constrained("regex", regex, temperature=1.0, seed=3), logit_bias=bias, repetition_penalty=1.5),
        *penalised_params()[:3],
    ]
    prompts = [[70, 33], [71, 33], [90, 91, 92], [80, 81], [60, 61, 62, 63]]
    outputs = engine.generate(prompts, params)
    for i, out in enumerate(outputs[:2]):
        what = f"constrained request {i} with logit_bias +100 on 'x' and -100 on the digits 0-6"
        assert_follows(out.text, out.finish_reason, "regex", regex, what)
        assert set(out.text) <= allowed, f"{what}: only 7, 8 and 9 keep a chance, got {out.text!r}"
    assert_penalties_like_stage3(tiny_llama, prompts[2:], params[2:], outputs[2:], "free requests beside grammars")
    check_all(engine, "after a constrained batch with penalties")
