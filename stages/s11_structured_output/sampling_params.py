"""``StructuredSamplingParams``: stage 2's SamplingParams plus the grammar the output must follow.

A request names at most one grammar: ``json_schema`` (a JSON schema, as a dict or its JSON text;
``{"type": "object"}`` is OpenAI's JSON mode) or ``regex`` (SGLang's extension). The schema is
stored as compact JSON text in the order it was written (``canonical_schema``): the grammar cache
is keyed by ``grammar_key`` = (kind, text), so one schema, however it is spaced, compiles once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from s02_request_and_sampling.sampling_params import SamplingParams

GrammarKind = Literal["json", "regex"]
GrammarKey = tuple[GrammarKind, str]

JSON_OBJECT_SCHEMA = '{"type":"object"}'  # OpenAI's response_format {"type": "json_object"}


@dataclass
class StructuredSamplingParams(SamplingParams):
    json_schema: str | dict[str, Any] | None = None  # the output is JSON valid against this schema
    regex: str | None = None  # the output matches this regular expression (in full)

    def _validate(self) -> None:
        super()._validate()
        raise NotImplementedError(
            "Stage 11: at most one grammar, well formed; ignore_eos and min_new_tokens cannot go with one - see stages/s11_structured_output/README.md#a-request-names-its-grammar"  # noqa: E501 (one message, the learner's to read whole)
        )

    @property
    def grammar_key(self) -> GrammarKey | None:
        """What the grammar cache is keyed by; None for a free request."""
        if self.json_schema is not None:
            return ("json", str(self.json_schema))
        if self.regex is not None:
            return ("regex", self.regex)
        return None


def canonical_schema(schema: str | dict[str, Any]) -> str:
    """A JSON schema as compact JSON text, its keys in the order given; ValueError if it is not a
    JSON object.

    Only the spelling is normalised (spaces, indentation, escapes), never the order: the grammar
    writes an object's properties in the order its schema lists them (as OpenAI's structured
    outputs do), so a schema listing name before age and one listing age before name are two
    grammars. Sorting the keys would hand a client asking for {"name", "age"} the age first."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"json_schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object (a dict), got {type(schema).__name__}")
    where = non_finite_at(schema)
    if where is not None:  # Python's JSON reads NaN and Infinity; JSON has no such numbers, nor has llguidance
        raise ValueError(f"json_schema holds {where[1]} at {where[0] or 'its top'}; a JSON schema's numbers are finite")
    return json.dumps(schema, separators=(",", ":"))


def non_finite_at(value: Any) -> tuple[str, float] | None:
    """(where, the number) of a NaN or infinity in a parsed JSON value, or None. A walk with a
    stack of its own, not recursion: a schema may be nested as deep as the body parser allows."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path, item
        items = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        stack.extend((f"{path}.{key}" if path else str(key), child) for key, child in reversed(list(items)))
    return None
