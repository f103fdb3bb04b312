"""What the grammar buys and what it costs, measured (the milestone and notebook 11 use these).

``validity_rates``: the same requests (prompts that ask for JSON) sampled with and without the
schema as a grammar; the share of outputs that parse and validate (``jsonschema``).
``mask_cost``: for one grammar, the time to fill a request's bitmask and to apply it to a row of
logits, per token, beside the time of a decode step of the same engine.
"""

from __future__ import annotations

import json
import statistics
import time

import jsonschema
import torch

from s02_request_and_sampling.sampling_params import SamplingParams

from .sampling_params import StructuredSamplingParams
from .vocab_mask import apply_token_bitmask

CASES = {
    "person": (
        "Give me a person as JSON with a name and an age.",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    "colors": (
        "List two colors as JSON: an object with a key colors holding an array.",
        {
            "type": "object",
            "properties": {
                "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "maxItems": 4}
            },
            "required": ["colors"],
            "additionalProperties": False,
        },
    ),
    "rating": (
        "Rate the movie Jaws as JSON with a score from 1 to 5 and a verdict, good or bad.",
        {
            "type": "object",
            "properties": {
                "score": {"type": "integer", "minimum": 1, "maximum": 5},
                "verdict": {"enum": ["good", "bad"]},
            },
            "required": ["score", "verdict"],
            "additionalProperties": False,
        },
    ),
}


def is_valid(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON that validates against ``schema`` (a fenced ```json block counts too)."""
    text = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def validity_rates(engine, samples: int = 4, max_new_tokens: int = 64, cases=CASES) -> dict[str, dict]:
    """For each case: the share of valid outputs without and with the grammar (``samples`` seeded
    draws at temperature 0.7 each, all in one batch), and one output of each."""
    prompts, params, where = [], [], []
    for name, (prompt, schema) in cases.items():
        for mode in ("free", "grammar"):
            grammar = {"json_schema": schema} if mode == "grammar" else {}
            for seed in range(samples):
                prompts.append([{"role": "user", "content": prompt}])
                params.append(
                    StructuredSamplingParams(temperature=0.7, seed=seed, max_new_tokens=max_new_tokens, **grammar)
                )
                where.append((name, mode))
    results: dict[str, dict] = {name: {"free": 0.0, "grammar": 0.0} for name in cases}
    for (name, mode), out in zip(where, engine.generate(prompts, params)):
        results[name][mode] += is_valid(out.text, cases[name][1]) / samples
        results[name].setdefault(mode + "_example", out.text)
    return results


def mask_cost(engine, schema: dict, prompt: str, max_new_tokens: int = 48) -> dict[str, float]:
    """Per token of one constrained greedy output: the median time to fill its bitmask and to apply
    it to a row of logits (milliseconds), beside the median decode step of the same engine."""
    params = StructuredSamplingParams(temperature=0, max_new_tokens=max_new_tokens, json_schema=schema)
    [out] = engine.generate([[{"role": "user", "content": prompt}]], params)
    backend = engine.scheduler.grammar_backend
    grammar = backend.new_grammar(backend.get(params.grammar_key).result())
    vocab = engine.model.config.vocab_size
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    logits = torch.randn(1, vocab)
    fill, apply = [], []
    for token in out.output_ids:
        start = time.perf_counter()
        grammar.fill_mask(bitmask, 0)
        middle = time.perf_counter()
        apply_token_bitmask(logits.clone(), bitmask)
        apply.append(time.perf_counter() - middle)
        fill.append(middle - start)
        grammar.accept_token(token)
    # a decode step of the same engine, free: the forward and sampling of one token
    engine.generate([[{"role": "user", "content": prompt}]], SamplingParams(temperature=0, max_new_tokens=16))
    steps = [t.forward[1] - t.forward[0] for t in list(engine.scheduler.timeline)[-14:]]
    return {
        "tokens": len(out.output_ids),
        "fill_ms": 1e3 * statistics.median(fill),
        "apply_ms": 1e3 * statistics.median(apply),
        "decode_step_ms": 1e3 * statistics.median(steps),
    }
