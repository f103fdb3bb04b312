"""Stage 9 (graded): the detokenizer worker's per-request logic, without a server.

Text goes out a piece per step, never half a UTF-8 character, never text that later turns out to
be (part of) a stop string, and the pieces joined are exactly what the offline engine's
``Req.output_text`` gives for the same tokens (stop strings trimmed, a stop token / EOS dropped).
A request's log-probability entries go out with their text, never ahead of it, and a cut stop
string's or an EOS's tokens have none."""

from __future__ import annotations

import random

import pytest

from reference import engine_tokenizer
from s02_request_and_sampling.logprobs import TokenLogprob
from s02_request_and_sampling.req import FinishReason, Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s09_zmq_serving.detokenizer_manager import DecodeStatus, stop_hold_back
from s09_zmq_serving.logprob_stream import LogprobStream

EOS = 257  # the tiny models' <|im_end|>


@pytest.mark.parametrize(
    "text, stops, expected",
    [
        ("Sure!\n\nUs", ["\n\nUser:"], 4),  # "\n\nUs" may still become "\n\nUser:"
        ("Sure!", ["\n\nUser:"], 0),
        ("ab", ["b", "abc"], 2),  # "ab" is the start of "abc" ("b" alone is a whole stop string, not a start)
        ("xa", ["a"], 0),  # a complete stop string is not held back: it is cut
        ("hello wor", ["world", "or not"], 3),  # the longest candidate wins
        ("", ["x"], 0),
        ("abc", [], 0),
    ],
)
def test_stop_hold_back(text, stops, expected):
    got = stop_hold_back(text, stops)
    assert got == expected, (
        f"stop_hold_back({text!r}, {stops!r}) returned {got}, expected {expected}: the longest end of the text that "
        f"is the beginning (not the whole) of a stop string"
    )


def byte_ids(text: str) -> list[int]:
    return list(text.encode())  # the tiny models' tokenizer: one token per UTF-8 byte


def feed(status: DecodeStatus, ids: list[int], finish_reason=None) -> list[str]:
    """One token per step; the last step carries finish_reason. Returns the pieces."""
    return [status.step([t], finish_reason if i == len(ids) - 1 else None) for i, t in enumerate(ids)]


def test_multibyte_characters_are_never_split(tiny_models_root):
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    text = "né 中文 ☃!"
    status = DecodeStatus(tokenizer, stops=[])
    pieces = feed(status, byte_ids(text), FinishReason("length"))
    for i, piece in enumerate(pieces):
        assert "\ufffd" not in piece, (
            f"after token {i} the detokenizer sent {piece!r}: half a UTF-8 character (U+FFFD); it must wait for the "
            f"character's last byte. Pieces so far: {pieces[: i + 1]}"
        )
    assert "".join(pieces) == text, f"the pieces {pieces} joined give {''.join(pieces)!r}, expected {text!r}"
    first = byte_ids("né")
    assert pieces[: len(first)] == ["n", "", "é"], (
        f"'né' is 3 byte tokens: expected pieces ['n', '', 'é'], got {pieces[:3]}"
    )


def test_a_possible_stop_string_is_held_back_then_cut(tiny_models_root):
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    stop = "\n\nUser:"
    status = DecodeStatus(tokenizer, stops=[stop])
    pieces = feed(status, byte_ids("Sure!\n\nUs"))
    assert "".join(pieces) == "Sure!", (
        f"after 'Sure!\\n\\nUs' with stop string {stop!r} the client may only have seen 'Sure!' (the tail may become "
        "the "
        f"stop string); it got {''.join(pieces)!r}"
    )
    more = feed(status, byte_ids("er:"), FinishReason("stop", matched=stop))
    assert "".join(pieces + more) == "Sure!", (
        f"the stop string completed: the final text is 'Sure!' (stop string trimmed), but the pieces joined give "
        f"{''.join(pieces + more)!r}"
    )


def test_a_held_back_tail_is_released_when_it_is_not_a_stop_string(tiny_models_root):
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    status = DecodeStatus(tokenizer, stops=["\n\nUser:"])
    pieces = feed(status, byte_ids("Sure!\n\nUs"))
    later = feed(status, byte_ids("ing it"))
    assert "".join(pieces + later) == "Sure!\n\nUsing it", (
        f"'\\n\\nUs' turned into '\\n\\nUsing', which is no stop string: it must be sent as soon as that is clear; "
        f"the pieces joined give {''.join(pieces + later)!r}"
    )
    end = feed(status, byte_ids("\n\nU"), FinishReason("length"))
    assert "".join(pieces + later + end) == "Sure!\n\nUsing it\n\nU", (
        "the request ended on 'length' with a held-back tail: the tail is text and must be sent at the end; "
        f"got {''.join(pieces + later + end)!r}"
    )


def random_output(rng: random.Random) -> list[int]:
    """Token ids mixing ASCII, multi-byte characters, stray continuation bytes and an EOS now and then."""
    ids: list[int] = []
    while len(ids) < 40:
        kind = rng.random()
        if kind < 0.5:
            ids += byte_ids(rng.choice(["a", "b", " ", "\n", "ab", "ba", "x"]))
        elif kind < 0.8:
            ids += byte_ids(rng.choice(["é", "中", "☃", "ü"]))
        elif kind < 0.95:
            ids.append(rng.randrange(128, 192))  # a lone continuation byte: invalid UTF-8
        else:
            ids.append(EOS)
    return ids


@pytest.mark.parametrize("seed", range(12))
def test_pieces_join_to_the_offline_engines_text(tiny_models_root, seed):
    """The same tokens through stage 2's Req (what the offline engine returns) and through the
    detokenizer: the pieces joined must equal req.output_text, and at every step what was sent is
    a prefix of that final text (nothing is ever taken back)."""
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    rng = random.Random(seed)
    ids = random_output(rng)
    stops = rng.choice([[], ["ab"], ["\n", "é中"], ["ba b", "x"], ["☃☃"]])
    stop_ids = rng.choice([[], byte_ids("b")])  # a stop token that is text, unlike EOS
    max_new = rng.randint(10, 40)
    assert_streams_the_offline_text(tokenizer, ids, stops, stop_ids, max_new, f"seed {seed}")


def test_half_a_character_before_eos_is_still_sent(tiny_models_root):
    # 'a', then the first byte of a two-byte character, then EOS: the request's text is 'a' and
    # that lone byte (U+FFFD), everything before the EOS, even what the detokenizer still holds.
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    assert_streams_the_offline_text(tokenizer, [97, 0xC3, EOS], [], [], 10, "'a', half of 'é', EOS")


def test_a_stop_string_inside_a_many_character_token_is_cut(default_model_dir):
    # SmolLM2's tokens are words: " Paris" is one token, and the stop string "Par" ends inside
    # it. The search window is counted in characters of new text, not in new tokens.
    tokenizer = engine_tokenizer(str(default_model_dir))
    ids = tokenizer.encode("The capital of France is Paris, a city.")
    assert_streams_the_offline_text(tokenizer, ids, ["Par"], [], 40, "SmolLM2's tokens, stop string 'Par'")


def assert_streams_the_offline_text(tokenizer, ids, stops, stop_ids, max_new: int, name: str) -> None:
    """Feed ``ids`` one per step to a Req and a DecodeStatus: the pieces joined must be the Req's
    output_text, and no step may send what a later one takes back."""
    __tracebackhide__ = True
    params = SamplingParams(max_new_tokens=max_new, stop=stops, stop_token_ids=stop_ids)
    req = Req("r", [65], params, tokenizer=tokenizer)
    status = DecodeStatus(tokenizer, stops)
    sent = []
    for token in ids:
        req.append_token(token)
        req.check_finished()
        sent.append(status.step([token], req.finished_reason))
        if req.finished:
            break
    final = req.output_text
    what = (
        f"{name}: tokens {req.output_ids}, stop strings {stops}, stop_token_ids {stop_ids}, "
        f"finish {req.finished_reason}"
    )
    joined = "".join(sent)
    on_a_token = req.finished_reason is not None and isinstance(req.finished_reason.matched, int)
    if final.startswith(joined) and len(joined) < len(final):
        hint = (
            f" (its last {len(final) - len(joined)} character(s) never came: when the request ends, all of its text is "
            "sent, the tail the detokenizer still holds too - flush it, even half a UTF-8 character"
            + (", up to the stop token or EOS that ended it)" if on_a_token else ")")
        )
    elif on_a_token:
        hint = " (the request ended on a stop token or EOS, which is not text: the text ends before it)"
    elif joined.startswith(final) and stops:
        hint = (
            " (a stop string went out: find it in the characters the step added, new_len = len(new text), which "
            "one token of a real tokenizer can make several of)"
        )
    else:
        hint = ""
    assert joined == final, f"{what}: the pieces joined give {joined!r}, the offline engine's text is {final!r}{hint}"
    for step in range(len(sent)):
        so_far = "".join(sent[: step + 1])
        assert final.startswith(so_far), (
            f"{what}: after step {step} the client had seen {so_far!r}, which is not a beginning of the final text "
            f"{final!r}: text was sent that later had to be taken back"
        )


# --- log-probabilities go out with their text (logprob_stream.py) ---------------------------------


def numbered(ids: list[int]) -> list[TokenLogprob]:
    """A TokenLogprob per token whose logprob is minus its place, so an entry says which token it is."""
    return [TokenLogprob(t, -float(i), ((t, -float(i)),)) for i, t in enumerate(ids)]


def feed_logprobs(tokenizer, stops, ids, finish_reason):
    """One token per step through a DecodeStatus and its LogprobStream; returns [(text, entries)] per step."""
    status, stream = DecodeStatus(tokenizer, stops), LogprobStream(tokenizer)
    steps = []
    for i, (token, logprob) in enumerate(zip(ids, numbered(ids))):
        steps.append(stream.step(status, [token], [logprob], finish_reason if i == len(ids) - 1 else None))
    return steps


def test_an_entry_waits_for_its_text(tiny_models_root):
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    steps = feed_logprobs(tokenizer, [], byte_ids("né!"), FinishReason("length"))
    counts = [len(entries) for _, entries in steps]
    assert counts == [1, 0, 2, 1], (
        f"'né!' is 4 byte tokens; 'é' is two, and its first byte sends no text, so its entry must wait and go out "
        f"with the second's: entries per step should be [1, 0, 2, 1], got {counts}"
    )
    entries = [e for _, step in steps for e in step]
    assert [e.token_bytes for e in entries] == [b"n", b"\xc3", b"\xa9", b"!"], (
        f"each entry carries its token's exact bytes (half of 'é' included), got {[e.token_bytes for e in entries]}"
    )
    assert entries[1].token == "\ufffd" and [e.text_offset for e in entries] == [0, 1, 1, 2], (
        f"half a character shows as U+FFFD, and each entry's text_offset is where its text starts in 'né!' (both "
        f"halves of 'é' at 1): got tokens {[e.token for e in entries]}, offsets {[e.text_offset for e in entries]}"
    )


def test_a_stop_strings_entries_are_dropped_a_stop_tokens_has_no_text(tiny_models_root):
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    stop = "\n\nUser:"
    steps = feed_logprobs(tokenizer, [stop], byte_ids("Sure!\n\nUser:"), FinishReason("stop", matched=stop))
    entries = [e for _, step in steps for e in step]
    assert [e.logprob for e in entries] == [0, -1, -2, -3, -4], (
        f"the stop string {stop!r} is cut from the text, so its tokens' entries are dropped: the entries should be "
        f"those of 'Sure!' (tokens 0-4), got tokens {[-e.logprob for e in entries]}"
    )
    held = [len(step) for _, step in steps[5:-1]]
    assert held == [0] * len(held), f"while the tail may become the stop string, its entries wait; got {held}"
    steps = feed_logprobs(tokenizer, [], [*byte_ids("ok"), EOS], FinishReason("stop", matched=EOS))
    entries = [e for _, step in steps for e in step]
    assert [(e.token_bytes, e.logprob) for e in entries] == [(b"o", 0), (b"k", -1), (b"", -2)], (
        "a matched stop token / EOS is not part of the text, yet it was generated (usage counts it): its entry goes "
        f"last, with no text; got {[(e.token_bytes, e.logprob) for e in entries]}"
    )
    assert entries[-1].text_offset == 2, f"its text_offset is the text's end (2), got {entries[-1].text_offset}"


def test_a_control_token_inside_the_answer_adds_no_text(tiny_models_root):
    """The text leaves control tokens out (skip_special_tokens); one written mid-answer keeps its
    entry, with the text it adds (none), so the entries' bytes still join to the text, while its
    alternatives name it."""
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    control = 256  # the tiny models' <|im_start|>
    steps = feed_logprobs(tokenizer, [], [*byte_ids("ok"), control, *byte_ids("!")], FinishReason("length"))
    text = "".join(sent for sent, _ in steps)
    entries = [e for _, step in steps for e in step]
    assert text == "ok!" and [e.logprob for e in entries] == [0, -1, -2, -3], (
        f"'ok', a control token, '!': the text is 'ok!' and every token has its entry; got {text!r} and tokens "
        f"{[-e.logprob for e in entries]}"
    )
    assert [(e.token, e.token_bytes) for e in entries] == [("o", b"o"), ("k", b"k"), ("", b""), ("!", b"!")], (
        "a control token adds nothing to the text, so its entry's token and bytes are empty (the bytes joined spell "
        f"the text); got {[(e.token, e.token_bytes) for e in entries]}"
    )
    assert [e.text_offset for e in entries] == [0, 1, 2, 2], (
        f"the control token takes no room: '!' starts where it does (2); got {[e.text_offset for e in entries]}"
    )
    assert entries[2].top[0][0] == "<|im_start|>", (
        f"as an alternative a control token is named, got {entries[2].top[0]!r}"
    )


@pytest.mark.parametrize("seed", range(8))
def test_entries_follow_the_text_sent(tiny_models_root, seed):
    """Random outputs (multi-byte characters, stray bytes, stop strings and tokens): entries go out
    in token order, never ahead of their text, and at the end every token the answer shows has one."""
    tokenizer = engine_tokenizer(str(tiny_models_root / "llama"))
    rng = random.Random(seed)
    ids = random_output(rng)
    stops = rng.choice([[], ["ab"], ["\n", "é中"], ["ba b", "x"]])
    req = Req(f"r{seed}", [65], SamplingParams(max_new_tokens=rng.randint(10, 40), stop=stops), tokenizer=tokenizer)
    status, stream = DecodeStatus(tokenizer, stops), LogprobStream(tokenizer)
    sent, entries = "", []
    for token, logprob in zip(ids, numbered(ids)):
        req.append_token(token)
        req.check_finished()
        text, new = stream.step(status, [token], [logprob], req.finished_reason)
        sent += text
        entries += new
        assert [-e.logprob for e in entries] == list(range(len(entries))), (
            f"seed {seed}: entries must go out once each, in token order; got tokens {[-e.logprob for e in entries]}"
        )
        assert all(e.text_offset <= len(sent) for e in entries), (
            f"seed {seed}: an entry went out before its text: offsets {[e.text_offset for e in entries]}, "
            f"{len(sent)} characters sent"
        )
        if req.finished:
            break
    reason = req.finished_reason
    shown = len(req.output_ids)  # (a matched stop token / EOS has its entry too, with no text)
    if reason is not None and isinstance(reason.matched, str):
        assert len(entries) <= shown and all(e.text_offset < len(sent) for e in entries), (
            f"seed {seed}: cut at a stop string, only tokens that start before it keep their entry"
        )
    else:
        assert len(entries) == shown, (
            f"seed {seed}: finished with {reason}: {shown} tokens were generated, {len(entries)} entries went out"
        )
