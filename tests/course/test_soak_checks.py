"""The soak's own checks (tools/soak_serving.py, not graded): an answer that ended by itself is
held to its grammar, a JSON object's keys to the schema's order; an answer with log-probabilities
to its text (the entries' bytes spell it) and to the alternatives asked for; a hostile request
stays short enough to be answered within the client's timeout."""

from __future__ import annotations

import random

from soak_serving import SCHEMAS, grammar_problems, hostile_request, logprob_problems, stream_problems

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


def chat_entry(data: bytes, logprob: float, alternatives: int) -> dict:
    top = [{"token": "x", "logprob": -5.0, "bytes": [120]}] * alternatives
    return {"token": data.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(data), "top_logprobs": top}


def test_logprobs_that_spell_the_text_pass_and_the_others_do_not():
    body = {"logprobs": True, "top_logprobs": 1}
    good = [{"logprobs": {"content": [chat_entry(b"h\xc3", -0.5, 1), chat_entry(b"\xa9", -0.1, 1)]}}]
    assert logprob_problems(True, body, good, "hé") == []
    [problem] = logprob_problems(True, body, good, "he")
    assert "the entries' bytes spell" in problem
    positive = [{"logprobs": {"content": [chat_entry(b"h", 0.5, 1)]}}]
    assert "finite number <= 0" in logprob_problems(True, body, positive, "h")[0]
    assert "alternatives" in logprob_problems(True, {**body, "top_logprobs": 2}, good, "hé")[0]
    completion = [
        {
            "logprobs": {
                "tokens": ["h", "bytes:\\xc3", "bytes:\\xa9"],
                "token_logprobs": [-1.0] * 3,
                "top_logprobs": [{}] * 3,
                "text_offset": [0, 1, 1],
            }
        }
    ]
    assert logprob_problems(False, {"logprobs": 0}, completion, "hé") == []
    assert logprob_problems(True, body, [{"logprobs": None}], "h"), "asked and got none: a problem"


def test_an_echoed_prompts_first_entry_is_null():
    """With echo, the prompt's first token has null logprob and alternatives: accepted there, a
    problem anywhere else (and its absence a problem with echo)."""
    echoed = {"tokens": ["h", "i", "!"], "token_logprobs": [None, -1.0, -0.5], "top_logprobs": [None, {}, {}]}
    choices = [{"logprobs": {**echoed, "text_offset": [0, 1, 2]}}]
    assert logprob_problems(False, {"logprobs": 0, "echo": True}, choices, "hi!") == []
    assert logprob_problems(False, {"logprobs": 0}, choices, "hi!"), "a null logprob without echo: a problem"
    plain = [{"logprobs": {**echoed, "token_logprobs": [-2.0, -1.0, -0.5], "top_logprobs": [{}] * 3}}]
    assert "null" in logprob_problems(False, {"logprobs": 0, "echo": True}, plain, "hi!")[0]
    # streamed: only each choice's first chunk starts with the prompt
    chunks = [
        {"index": 0, "logprobs": {"tokens": ["h"], "token_logprobs": [None], "top_logprobs": [None]}},
        {"index": 0, "logprobs": {"tokens": ["i"], "token_logprobs": [-1.0], "top_logprobs": [{}]}},
    ]
    assert logprob_problems(False, {"logprobs": 0, "echo": True}, chunks, "hi") == []
    # a token-id prompt that ends inside a character: the prompt and the answer decode on their own
    split = [{"logprobs": {"tokens": ["h", "bytes:\\xc3", "bytes:\\xa9"], "token_logprobs": [None, -1.0, -1.0]}}]
    split[0]["logprobs"]["top_logprobs"] = [None, {}, {}]
    body = {"logprobs": 0, "echo": True, "prompt": [1, 2]}
    assert logprob_problems(False, body, split, "h\ufffd\ufffd") == []


def chunk(index: int, text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": index, "text": text, "finish_reason": finish}]}


def test_a_stream_of_n_choices_ends_each_choice_once():
    good = [chunk(0, "a"), chunk(1, "b"), chunk(1, "", "length"), chunk(0, "", "stop")]
    assert stream_problems(good, False, False, n=2) == []
    assert any("choice 1" in p for p in stream_problems(good[:2] + good[3:], False, False, n=2))
    assert any("0..2" in p for p in stream_problems(good, False, False, n=3)), "a missing choice is a problem"
    twice = [chunk(0, "a", "stop"), chunk(0, "", "stop")]
    assert stream_problems(twice, False, False) != []


def test_a_hostile_request_never_leaves_max_tokens_unbounded():
    # max_tokens null is absent: a run to the end of the context, minutes on a CPU, so the soak
    # counted a legitimate long answer as a client that waited in vain (found in a 5-minute soak).
    rng = random.Random(0)
    bodies = [body for _, _, body in (hostile_request(rng, "m") for _ in range(5000)) if body is not None]
    assert all(body.get("max_tokens") is not None for body in bodies)
    assert sum(body["max_tokens"] not in range(1, 9) for body in bodies) > 50  # hostile values still drawn
