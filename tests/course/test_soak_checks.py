"""The soak's own grammar check (tools/soak_serving.py, not graded): an answer that ended by
itself is held to its grammar, a JSON object's keys to the schema's order."""

from __future__ import annotations

from soak_serving import SCHEMAS, grammar_problems

TAGGED = SCHEMAS[1]  # properties n, then tag


def test_an_answer_that_follows_its_grammar_passes():
    assert grammar_problems('{"n":7,"tag":"a"}', TAGGED, None) == []
    assert grammar_problems("dogs!", None, r"(cat|dog)s?!") == []


def test_keys_out_of_the_schemas_order_are_a_problem():
    [problem] = grammar_problems('{"tag":"a","n":7}', TAGGED, None)
    assert "writes its keys as ['tag', 'n'], the schema lists ['n', 'tag']" in problem


def test_invalid_json_a_schema_violation_and_a_regex_miss_are_problems():
    for text in ('{"n":7', '{"n":100,"tag":"a"}', '{"n":7,"tag":"c"}'):
        assert grammar_problems(text, TAGGED, None), text
    assert grammar_problems("dogs", None, r"(cat|dog)s?!")
