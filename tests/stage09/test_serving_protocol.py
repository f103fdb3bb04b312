"""Stage 9 (graded): an OpenAI request becomes stage 2's SamplingParams, and impossible values are
refused with the API's own field name (the server turns these into 400 answers)."""

from __future__ import annotations

import pytest

from s09_zmq_serving.protocol import ChatCompletionRequest, CompletionRequest, InvalidRequest, to_sampling_params

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_fields_become_sampling_params():
    request = ChatCompletionRequest(
        model="m",
        messages=MESSAGES,
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=3,
        stop="END",
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        logit_bias={"7": -100, "42": 2.5},
        min_tokens=3,
    )
    params, fill = to_sampling_params(request)
    got = dict(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        stop=params.stop,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=params.logit_bias,
        min_new_tokens=params.min_new_tokens,
    )
    expected = dict(
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=3,
        stop=["END"],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        logit_bias={7: -100, 42: 2.5},
        min_new_tokens=3,
    )
    assert got == expected, f"the request's fields should map onto SamplingParams as {expected}, got {got}"
    assert fill is False, "max_tokens was given, so the request must not be told to run to the end of the context"


def test_defaults_and_max_completion_tokens():
    params, fill = to_sampling_params(CompletionRequest(model="m", prompt="Hi"))
    assert fill is True, "without max_tokens the request runs to the end of the context: the second value must be True"
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (1.0, 1.0, -1, []), (
        f"fields left out keep SamplingParams' defaults (temperature 1, top_p 1, top_k -1, no stop), got "
        f"{(params.temperature, params.top_p, params.top_k, params.stop)}"
    )
    params, fill = to_sampling_params(
        ChatCompletionRequest(model="m", messages=MESSAGES, max_completion_tokens=9, stop=["a", "b"])
    )
    assert (params.max_new_tokens, fill, params.stop) == (9, False, ["a", "b"]), (
        f"max_completion_tokens=9 is max_tokens' newer name: expected max_new_tokens 9, got {params.max_new_tokens}"
    )
    params, fill = to_sampling_params(CompletionRequest(model="m", prompt="Hi", min_tokens=40))
    assert (params.min_new_tokens, params.max_new_tokens, fill) == (40, 40, True), (
        "min_tokens=40 without max_tokens: min_new_tokens 40, and max_new_tokens at least that until the scheduler "
        f"fills it (it must pass SamplingParams' check); got {(params.min_new_tokens, params.max_new_tokens, fill)}"
    )
    with pytest.raises(InvalidRequest) as caught:
        to_sampling_params(ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=5, max_completion_tokens=9))
    assert caught.value.param == "max_completion_tokens", (
        "max_tokens=5 with max_completion_tokens=9 is refused naming max_completion_tokens (the newer name, which "
        f"disagrees with the older); it named {caught.value.param!r}"
    )


def test_a_zero_is_a_value_not_a_field_left_out():
    params, _ = to_sampling_params(ChatCompletionRequest(model="m", messages=MESSAGES, seed=0, temperature=0))
    assert (params.seed, params.temperature) == (0, 0.0), (
        "seed=0 and temperature=0 are values the client chose: test a field with `is not None`, not its truth "
        f"(`request.seed or None` drops seed 0, and the request is then not reproducible); got seed={params.seed}, "
        f"temperature={params.temperature}"
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("min_p", 2),
        ("seed", -1),
        ("stop", [""]),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3),
        ("repetition_penalty", 2.5),
        ("logit_bias", {"5": -101}),
        ("logit_bias", {"x5": 1}),
        ("min_tokens", -1),
        ("min_tokens", 5),  # more than max_tokens (4)
    ],
)
def test_impossible_values_are_refused_naming_the_field(field, value):
    request = ChatCompletionRequest(model="m", messages=MESSAGES, **{"max_tokens": 4, field: value})
    try:
        to_sampling_params(request)
    except InvalidRequest as error:
        assert error.status_code == 400 and error.param == field, (
            f"{field}={value!r} must be refused with status 400 and param {field!r}; got status {error.status_code}, "
            f"param {error.param!r} ({error.message})"
        )
    else:
        pytest.fail(f"{field}={value!r} is impossible, yet to_sampling_params accepted it")


@pytest.mark.parametrize(
    "kind, fields, expected",
    [
        ("chat", {}, None),
        ("chat", {"logprobs": False}, None),
        ("chat", {"logprobs": True}, 0),
        ("chat", {"logprobs": True, "top_logprobs": 20}, 20),
        ("completion", {}, None),
        ("completion", {"logprobs": 0}, 0),
        ("completion", {"logprobs": 5}, 5),
    ],
)
def test_logprobs_in_both_spellings(kind, fields, expected):
    """A chat asks with logprobs: true and top_logprobs: k, a completion with logprobs: k; both become
    SamplingParams.logprobs = k (None: no log-probabilities)."""
    if kind == "chat":
        request = ChatCompletionRequest(model="m", messages=MESSAGES, **fields)
    else:
        request = CompletionRequest(model="m", prompt="Hi", **fields)
    params, _ = to_sampling_params(request)
    assert params.logprobs == expected, (
        f"a {kind} request with {fields or 'no logprobs fields'} should give SamplingParams.logprobs={expected}, got "
        f"{params.logprobs}"
    )
