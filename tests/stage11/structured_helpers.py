"""Shared by the stage-11 tests: the schemas and regexes every test draws from, a tiny-model
engine of stage 11, and the check that an output follows its grammar."""

from __future__ import annotations

import json
import re

import jsonschema

from invariants import check_all
from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s11_structured_output.engine import Engine
from s11_structured_output.sampling_params import StructuredSamplingParams

# Each one closed (additionalProperties false, bounded strings and arrays): a random tiny model
# would otherwise write keys and strings until max_new_tokens, and the output would be cut.
NAME = {"type": "string", "maxLength": 4}
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "nick": NAME},
                "required": ["id", "nick"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bounded_number": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["score"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 50}, "b": {"type": "null"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
}
REGEXES = [r"(yes|no)", r"[A-Z][a-z]{1,5}-[0-9]{2,4}", r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?!"]


def engine_on(path, **knobs) -> Engine:
    return Engine(engine_model(str(path)), engine_tokenizer(str(path)), **knobs)


def check_every_step(engine: Engine, what: str) -> Engine:
    """``engine``, its memory and grammar invariants checked after every step (generate's too)."""
    step = engine.step

    def checked_step():
        outputs = step()
        check_all(engine, what)
        return outputs

    engine.step = checked_step  # type: ignore[method-assign]
    return engine


def constrained(kind: str, spec, temperature: float = 0, seed: int | None = None, max_new_tokens: int = 60):
    grammar = {"json_schema": spec} if kind == "json" else {"regex": spec}
    return StructuredSamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens, **grammar)


def assert_follows(text: str, finish_reason, kind: str, spec, what: str) -> None:
    """The output ended by itself (EOS after a complete grammar) and follows its grammar."""
    assert finish_reason is not None and finish_reason.type == "stop", (
        f"{what}: a constrained output should end with EOS once its grammar is complete; it ended with "
        f"{finish_reason} after {text!r}"
    )
    if kind == "regex":
        assert re.fullmatch(spec, text), f"{what}: {text!r} does not match the regex {spec!r}"
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise AssertionError(f"{what}: the output {text!r} is not JSON ({error})") from None
    try:
        jsonschema.validate(value, spec)
    except jsonschema.ValidationError as error:
        raise AssertionError(f"{what}: {text!r} does not validate: {error.message}") from None


def mixed_workload():
    """Every schema and regex, greedy and seeded, between free requests: prompts, params and, per
    request, (kind, grammar, name) or None for a free one."""
    prompts, params, specs = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        prompts.append([40 + i, 50, 60 + i])
        params.append(constrained("json", schema, **({} if i % 2 else {"temperature": 0.9, "seed": i})))
        specs.append(("json", schema, name))
    for i, regex in enumerate(REGEXES):
        prompts.append([70 + i, 33])
        params.append(constrained("regex", regex, **({"temperature": 1.0, "seed": 7 + i} if i % 2 else {})))
        specs.append(("regex", regex, regex))
    for i in range(3):
        prompts.insert(2 * i + 1, [90 + i, 91, 92])
        params.insert(2 * i + 1, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
        specs.insert(2 * i + 1, None)
    return prompts, params, specs
