"""What the grammar buys and what it costs, measured (the milestone and notebook 11 use these).

``validity_rates``: the same requests (prompts that ask for JSON) sampled with and without the
schema as a grammar; the share of outputs that parse and validate (``jsonschema``).
``mask_walk``: one constrained greedy output step by step: how many tokens the grammar allowed,
and whether the model's own choice (the same logits, unmasked) was among them: where it steered.
``mask_cost``: for one grammar, the time to fill a request's bitmask and to apply it to a row of
logits, per token, beside the time of a decode step of the same engine.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import jsonschema
import torch

from s00_foundation.attention import NoCacheBackend
from s00_foundation.forward_batch import ForwardBatch
from s02_request_and_sampling.engine import encode
from s02_request_and_sampling.sampling_params import SamplingParams

from .grammar_backend import Grammar
from .sampling_params import StructuredSamplingParams
from .vocab_mask import allocate_token_bitmask, apply_token_bitmask

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


def constrained_greedy(engine, schema: dict, prompt: str, max_new_tokens: int) -> tuple[list[int], Grammar]:
    """One greedy output of ``prompt`` under ``schema`` (its token ids), and a fresh matcher of the
    same compiled grammar, at its start, to walk it again."""
    params = StructuredSamplingParams(temperature=0, max_new_tokens=max_new_tokens, json_schema=schema)
    [out] = engine.generate([[{"role": "user", "content": prompt}]], params)
    backend = engine.scheduler.grammar_backend
    return out.output_ids, backend.new_grammar(backend.get(params.grammar_key).result())


@dataclass
class MaskStep:
    """One token of a constrained greedy output."""

    token: str  # the token the output took (the best one the grammar allowed)
    allowed: int  # how many of the vocabulary's tokens the grammar allowed at this step
    model_choice: str  # the model's own greedy choice from the same logits, without the mask
    steered: bool  # the grammar forbade the model's own choice


def mask_walk(engine, schema: dict, prompt: str, max_new_tokens: int = 48) -> list[MaskStep]:
    """``prompt``'s greedy output under ``schema``, step by step: the mask at each step, and the
    model's own choice there (one forward over the prompt and the output computes every step's
    unmasked logits)."""
    output_ids, grammar = constrained_greedy(engine, schema, prompt, max_new_tokens)
    prompt_ids = encode(engine.tokenizer, [{"role": "user", "content": prompt}])
    batch = ForwardBatch.build(
        [prompt_ids + output_ids[:-1]], prefix_lens=[0], attn_backend=NoCacheBackend(), device=engine.model.device
    )
    own = engine.model(batch, return_all_logits=True)[len(prompt_ids) - 1 :].argmax(-1).tolist()
    vocab = engine.model.config.vocab_size
    bitmask = allocate_token_bitmask(1, vocab)

    def piece(token_id: int) -> str:
        return engine.tokenizer.decode([token_id], skip_special_tokens=False)

    steps = []
    for token, choice in zip(output_ids, own):
        grammar.fill_mask(bitmask, 0)
        row = torch.zeros(1, vocab)
        apply_token_bitmask(row, bitmask)  # 0 where allowed, -inf where forbidden
        allowed = torch.isfinite(row[0])
        steps.append(MaskStep(piece(token), int(allowed.sum()), piece(choice), not bool(allowed[choice])))
        grammar.accept_token(token)
    return steps


def mask_cost(engine, schema: dict, prompt: str, max_new_tokens: int = 48) -> dict[str, float]:
    """Per token of one constrained greedy output: the median time to fill its bitmask and to apply
    it to a row of logits (milliseconds), beside the median decode step of the same engine."""
    output_ids, grammar = constrained_greedy(engine, schema, prompt, max_new_tokens)
    vocab = engine.model.config.vocab_size
    bitmask = allocate_token_bitmask(1, vocab)
    logits = torch.randn(1, vocab)
    fill, apply = [], []
    for token in output_ids:
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
        "tokens": len(output_ids),
        "fill_ms": 1e3 * statistics.median(fill),
        "apply_ms": 1e3 * statistics.median(apply),
        "decode_step_ms": 1e3 * statistics.median(steps),
    }
