"""Req: its lengths, and when and why it finishes (stop tokens, EOS, stop strings, length).

Tokens are fed by hand through a byte-level tokenizer (token id == byte value), so every
multi-character stop string spans several tokens and "é" / "。" take two / three tokens.
"""

from __future__ import annotations

import pytest

from s02_request_and_sampling.req import FinishReason, Req, find_stop_str
from s02_request_and_sampling.sampling_params import SamplingParams

EOS = 257  # <|im_end|> in the tiny models' tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_models_root):
    from s00_foundation.tokenizer import Tokenizer

    return Tokenizer(tiny_models_root / "llama")


def make_req(tokenizer, **params) -> Req:
    return Req(rid="r0", origin_input_ids=[72, 105], sampling_params=SamplingParams(**params), tokenizer=tokenizer)


def feed(req: Req, ids: list[int]) -> int | None:
    """Append tokens one by one as the engine does; return the index of the token after which
    the request finished (None if it never did)."""
    for i, token in enumerate(ids):
        req.append_token(token)
        req.check_finished()
        if req.finished:
            return i
    return None


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def expect_stop(req, ids, text, stop_at: int, reason: FinishReason, output_text: str):
    at = feed(req, ids)
    shown = [bytes([b]).decode("latin-1") if b < 256 else b for b in ids]
    assert at == stop_at, (
        f"feeding {text!r} one token at a time with {req.sampling_params}: the request should finish right after "
        f"token {stop_at} ({shown[stop_at]!r}), yours finished "
        + ("never" if at is None else f"after token {at} ({shown[at]!r})")
    )
    assert req.finished_reason == reason, f"finished_reason should be {reason}, got {req.finished_reason}"
    assert req.output_ids == ids[: stop_at + 1], (
        "output_ids should hold every token generated, up to the one that stopped it"
    )
    assert req.output_text == output_text, f"output_text should be {output_text!r}, got {req.output_text!r}"


# --- lengths ----------------------------------------------------------------------------------


def test_lengths_follow_the_tokens(tokenizer):
    req = Req(rid=7, origin_input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=10), tokenizer=tokenizer)
    assert (req.cached_len, req.device_len, req.extend_len) == (0, 3, 3), (
        f"a new request has cached_len=0, device_len=3 (the prompt), extend_len=3; got {req!r}"
    )
    feed(req, [65, 66])
    assert req.fill_ids == [1, 2, 3, 65, 66] and req.output_ids == [65, 66]
    assert (req.cached_len, req.device_len, req.extend_len) == (0, 5, 5), (
        f"after 2 tokens with nothing cached: cached_len=0, device_len=5, extend_len=5; got {req!r}"
    )
    assert not req.finished and req.finished_reason is None


# --- stop tokens, EOS and length --------------------------------------------------------------


def test_max_new_tokens_finishes_with_length(tokenizer):
    ids = utf8("abcdefgh")
    expect_stop(make_req(tokenizer, max_new_tokens=5), ids, "abcdefgh", 4, FinishReason("length"), "abcde")


def test_eos_finishes_with_stop_and_is_not_in_the_text(tokenizer):
    ids = utf8("hi!") + [EOS] + utf8("more")
    expect_stop(make_req(tokenizer), ids, "hi!<eos>more", 3, FinishReason("stop", EOS), "hi!")


def test_ignore_eos_goes_past_eos(tokenizer):
    ids = utf8("hi") + [EOS] + utf8("abc")
    expect_stop(
        make_req(tokenizer, ignore_eos=True, max_new_tokens=6), ids, "hi<eos>abc", 5, FinishReason("length"), "hiabc"
    )


def test_stop_token_ids_stop_even_with_ignore_eos(tokenizer):
    ids = utf8("one, two")
    comma = ord(",")
    expect_stop(
        make_req(tokenizer, stop_token_ids=[comma], ignore_eos=True),
        ids,
        "one, two",
        3,
        FinishReason("stop", comma),
        "one",
    )


def test_stop_beats_length_on_the_same_token(tokenizer):
    ids = utf8("ab") + [EOS]
    expect_stop(make_req(tokenizer, max_new_tokens=3), ids, "ab<eos>", 2, FinishReason("stop", EOS), "ab")
    ids = utf8("xEND")
    expect_stop(make_req(tokenizer, max_new_tokens=4, stop="END"), ids, "xEND", 3, FinishReason("stop", "END"), "x")


def test_a_stop_token_that_also_completes_a_stop_string_stops_as_the_token(tokenizer):
    # "D" is a stop token and ends the stop string "END": tokens are checked first, so the
    # request stopped on the token (not part of the text), and "EN" stays.
    req = make_req(tokenizer, stop="END", stop_token_ids=[ord("D")])
    feed(req, utf8("xEND"))
    assert (req.finished_reason, req.output_text) == (FinishReason("stop", ord("D")), "xEN"), (
        "'D' is a stop token and completes the stop string 'END': stop tokens are checked before stop strings, so "
        f"it stops on the token (finished_reason {FinishReason('stop', ord('D'))}, output_text 'xEN'); got "
        f"{req.finished_reason}, {req.output_text!r}"
    )


# --- stop strings -----------------------------------------------------------------------------


def test_stop_string_spanning_tokens_stops_and_is_trimmed(tokenizer):
    text = "The answer is 42.\nEND of story"
    ids = utf8(text)
    stop_at = text.index("\nEND") + len("\nEND") - 1
    expect_stop(
        make_req(tokenizer, stop=["\nEND"]), ids, text, stop_at, FinishReason("stop", "\nEND"), "The answer is 42."
    )


def test_stop_string_with_multibyte_characters(tokenizer):
    text = "café au lait。 fin"
    ids = utf8(text)
    stop_at = len("café au lait。".encode()) - 1  # "。" is 3 bytes: only its last byte completes it
    expect_stop(make_req(tokenizer, stop="。"), ids, text, stop_at, FinishReason("stop", "。"), "café au lait")
    stop_at = len("caf\u00e9".encode()) - 1
    expect_stop(make_req(tokenizer, stop="fé"), ids, text, stop_at, FinishReason("stop", "fé"), "ca")


def test_the_earliest_stop_string_wins(tokenizer):
    text = "a b c xyz"
    expect_stop(make_req(tokenizer, stop=["xyz", "b c"]), utf8(text), text, 4, FinishReason("stop", "b c"), "a ")
    # Two stop strings completed by the same token: the text ends before the one that starts first.
    text = "abcd!"
    expect_stop(make_req(tokenizer, stop=["cd", "bcd"]), utf8(text), text, 3, FinishReason("stop", "bcd"), "a")


def test_partial_stop_string_does_not_stop(tokenizer):
    text = "EN-ENDX-END"
    at = text.index("END") + 2
    expect_stop(make_req(tokenizer, stop="END"), utf8(text), text, at, FinishReason("stop", "END"), "EN-")


def test_text_without_a_stop_keeps_multibyte_characters_whole(tokenizer):
    text = "naïve 你好 ok"
    ids = utf8(text)
    req = make_req(tokenizer, stop="zzz", max_new_tokens=len(ids))
    expect_stop(req, ids, text, len(ids) - 1, FinishReason("length"), text)


@pytest.mark.parametrize(
    "text, new_len, stops, expected, why",
    [
        ("hello world", 2, ["world"], (6, "world"), "'ld' completes 'world', which began in earlier text"),
        ("abc STOP xyz", 3, ["STOP"], None, "'STOP' was complete before the new text 'xyz': it is not a new match"),
        (
            "a b c xyz",
            1,
            ["xyz", "b c", "c xyz"],
            (4, "c xyz"),
            "of the matches the new 'z' completes, 'c xyz' starts first",
        ),
        ("no stop here", 4, ["zzz"], None, "no stop string at all"),
        ("ends END", 0, ["END"], None, "no new text (a token that completed no character yet)"),
        ("x", 1, [], None, "no stop strings"),
    ],
)
def test_find_stop_str_searches_what_the_new_text_completed(text, new_len, stops, expected, why):
    got = find_stop_str(text, new_len, stops)
    assert got == expected, (
        f"find_stop_str({text!r}, new_len={new_len}, {stops}) returned {got!r}, expected {expected!r}: {why}"
    )


class CountingTokenizer:
    """Wraps a tokenizer and remembers how many ids each decode call was given."""

    def __init__(self, inner):
        self.inner, self.eos_token_ids, self.sizes = inner, inner.eos_token_ids, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_stop_string_check_only_decodes_the_new_tail(tokenizer):
    counting = CountingTokenizer(tokenizer)
    req = Req(
        rid=1,
        origin_input_ids=[72],
        sampling_params=SamplingParams(stop="never", max_new_tokens=1000),
        tokenizer=counting,
    )
    feed(req, utf8("lorem ipsum dolor sit amet, 你好 " * 12))
    biggest = max(counting.sizes)
    assert biggest <= 16, (
        f"checking stop strings decoded {biggest} tokens in one step: each step should decode only the newest "
        "tokens (use the request's IncrementalDetokenizer), not the whole output - that would cost O(n) per step"
    )
