"""SamplingParams: impossible values are refused at once, with a message naming the field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from s02_request_and_sampling.sampling_params import SamplingParams

BAD = [
    # (field, value, why it is impossible)
    ("temperature", -0.5, "a negative temperature"),
    ("temperature", math.nan, "NaN"),
    ("temperature", math.inf, "infinity"),
    ("temperature", "hot", "not a number"),
    ("top_k", 0, "0 (use -1 for 'off')"),
    ("top_k", -2, "a negative k other than -1"),
    ("top_k", 2.5, "a fraction"),
    ("top_p", 0.0, "0 (nothing could be kept)"),
    ("top_p", -0.1, "a negative probability"),
    ("top_p", 1.5, "more than 1"),
    ("top_p", math.nan, "NaN"),
    ("min_p", -0.01, "a negative probability"),
    ("min_p", 1.01, "more than 1"),
    ("min_p", math.inf, "infinity"),
    ("max_new_tokens", 0, "0 (nothing to generate)"),
    ("max_new_tokens", -5, "a negative count"),
    ("max_new_tokens", 3.0, "a float"),
    ("stop", "", "an empty stop string (it would match everywhere)"),
    ("stop", ["ok", ""], "an empty stop string in the list"),
    ("stop", [3], "a stop 'string' that is an int"),
    ("ignore_eos", "yes", "a string (True or False)"),
    ("ignore_eos", 1, "an int (True or False)"),
    ("stop_token_ids", [-1], "a negative token id"),
    ("stop_token_ids", [1.5], "a fractional token id"),
    ("seed", -1, "a negative seed"),
    ("seed", 1.5, "a fractional seed"),
    ("seed", 2**64, "a seed over 2**64 - 1 (torch's generator takes an unsigned 64-bit seed)"),
    ("logprobs", -1, "a negative number of alternatives"),
    ("logprobs", 21, "more than 20 alternatives"),
    ("logprobs", True, "a bool (say how many alternatives: 0 for the token's own only)"),
    ("logprobs", 2.0, "a float"),
    ("prompt_logprobs", -1, "a negative number of alternatives"),
    ("prompt_logprobs", 21, "more than 20 alternatives"),
    ("prompt_logprobs", True, "a bool (say how many alternatives: 0 for the token's own only)"),
    ("prompt_logprobs", "2", "a string"),
    ("repetition_penalty", 0, "0 (every repeated logit would become 0 or infinite)"),
    ("repetition_penalty", -1.2, "a negative penalty (it flips the logits' signs)"),
    ("repetition_penalty", 1e-300, "a penalty that float32 rounds to 0"),
    ("repetition_penalty", 2.5, "more than 2"),
    ("repetition_penalty", math.nan, "NaN"),
    ("frequency_penalty", 2.5, "more than 2 (OpenAI's range is [-2, 2])"),
    ("frequency_penalty", -3, "less than -2"),
    ("frequency_penalty", math.inf, "infinity"),
    ("presence_penalty", -2.01, "less than -2"),
    ("presence_penalty", "high", "not a number"),
    ("logit_bias", {5: 101}, "a bias over 100"),
    ("logit_bias", {5: -math.inf}, "an infinite bias (-100 is OpenAI's ban)"),
    ("logit_bias", {-1: 5}, "a negative token id"),
    ("logit_bias", {"5": 5}, "a token id as a string"),
    ("logit_bias", {5: True}, "a bool for a bias"),
    ("logit_bias", [5, 1], "a list instead of {token id: bias}"),
    ("min_new_tokens", -1, "a negative count"),
    ("min_new_tokens", 2.0, "a float"),
    ("min_new_tokens", 129, "more than max_new_tokens (128 by default): the request could never end in bounds"),
]


@pytest.mark.parametrize("field,value,why", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_impossible_value_raises_value_error(field, value, why):
    try:
        SamplingParams(**{field: value})
    except ValueError as err:
        assert field in str(err), (
            f"SamplingParams({field}={value!r}) raised ValueError({str(err)!r}); the message should "
            f"name the field '{field}' (and say what is allowed) so the caller knows what to fix"
        )
    else:
        pytest.fail(f"SamplingParams({field}={value!r}) was accepted, but {why} is impossible: raise ValueError")


GOOD: list[dict[str, Any]] = [
    dict(temperature=0.0),
    dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
    dict(top_k=1),
    dict(top_k=-1, top_p=1.0, min_p=0.0),
    dict(min_p=1.0),
    dict(max_new_tokens=1),
    dict(stop=["\n\n", "END"], stop_token_ids=[0, 7]),
    dict(ignore_eos=True, seed=0),
    dict(seed=2**63),
    dict(seed=2**64 - 1),
    dict(logprobs=0),
    dict(logprobs=20),
    dict(repetition_penalty=1.3, frequency_penalty=-2, presence_penalty=2),
    dict(repetition_penalty=0.01),
    dict(logit_bias={0: -100, 7: 100, 3: 0.5}),
    dict(min_new_tokens=16, max_new_tokens=16),
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[",".join(f"{k}={v!r}" for k, v in g.items()) for g in GOOD])
def test_valid_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for field, value in kwargs.items():
        assert getattr(params, field) == value, (
            f"SamplingParams({kwargs}) changed {field} to {getattr(params, field)!r}"
        )


def test_defaults_and_normalisation():
    params = SamplingParams(stop="###")
    assert params.stop == ["###"], f"a single stop string should become a list of one, got {params.stop!r}"
    default = SamplingParams()
    assert (default.temperature, default.top_k, default.top_p, default.min_p) == (1.0, -1, 1.0, 0.0)
    assert (default.stop, default.stop_token_ids, default.ignore_eos, default.seed) == ([], [], False, None)
    assert default.logprobs is None, f"by default no log-probabilities are computed, got logprobs={default.logprobs!r}"
    penalties = (default.repetition_penalty, default.frequency_penalty, default.presence_penalty, default.logit_bias)
    assert penalties == (1.0, 0.0, 0.0, {}) and not default.has_penalties, (
        f"by default nothing is penalised (repetition 1, frequency 0, presence 0, no logit_bias), got {penalties}"
    )
    assert SamplingParams(logit_bias=None).logit_bias == {}, "logit_bias=None means no bias: an empty dict"
    assert default.min_new_tokens == 0, (
        f"by default a request may end at once, got min_new_tokens={default.min_new_tokens}"
    )
    assert SamplingParams(min_new_tokens=1).has_penalties, (
        "min_new_tokens > 0 reshapes the logits (its stop tokens are banned at first): has_penalties must say so"
    )


@pytest.mark.parametrize(
    "kwargs,greedy",
    [
        (dict(temperature=0.0), True),
        (dict(top_k=1), True),
        (dict(temperature=0.0, top_p=0.5), True),
        (dict(temperature=1.0), False),
        (dict(temperature=0.2, top_k=2), False),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy, f"SamplingParams({kwargs}).is_greedy should be {greedy}"
