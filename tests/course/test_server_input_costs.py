"""What hostile input costs the server's provided code (stage 9's request models and tokenizer
manager; not exercises, so not graded): a body of a million bad items is refused with one error,
not a million (FastAPI lists them on the event loop), and a prompt far past the context is refused
before it is tokenized whole (the single tokenizer process would hold every other request)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from s00_foundation.tokenizer import Tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s09_zmq_serving.io_struct import GenerateReqInput
from s09_zmq_serving.protocol import ChatCompletionRequest
from s09_zmq_serving.tokenizer_manager import PromptError, TokenizerManager

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "Hi"}]


MILLION = 10**6


def many_keys(prefix: str, value) -> dict:
    return dict.fromkeys((f"{prefix}{i}" for i in range(MILLION)), value)


# (what, the body's fields beside the model, built when its test runs): each bad item an error
ITEMS_BY_THE_MILLION = [
    ("messages that are not objects", lambda: {"messages": [1] * MILLION}),
    ("content parts that are not objects", lambda: {"messages": [{"role": "user", "content": [1] * MILLION}]}),
    ("tool calls that are not objects", lambda: {"messages": [{"role": "assistant", "tool_calls": [1] * MILLION}]}),
    ("tools that are not objects", lambda: {"messages": MESSAGES, "tools": [1] * MILLION}),
    ("stop strings that are numbers", lambda: {"messages": MESSAGES, "stop": [1] * MILLION}),
    ("logit_bias values that are strings", lambda: {"messages": MESSAGES, "logit_bias": many_keys("", "x")}),
    ("unknown fields", lambda: {"messages": MESSAGES, **many_keys("field", 1)}),
    ("unknown fields of a message", lambda: {"messages": [{"role": "user", **many_keys("field", 1)}]}),
    ("good messages, more than any conversation holds", lambda: {"messages": [{"role": "user"}] * MILLION}),
]


@pytest.mark.parametrize(
    "fields", [case[1] for case in ITEMS_BY_THE_MILLION], ids=[case[0] for case in ITEMS_BY_THE_MILLION]
)
def test_a_million_bad_items_make_one_error(fields):
    """pydantic reports every bad item of a list, and the server's web framework turns each report
    into a dict on its event loop: two million took 20 s, in which no other client was answered.
    Every list of the body stops at its first bad item and holds at most a cap of them, and an
    object's unknown fields make one error (a union's members say one each: "not a string", "not a
    list of strings")."""
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"model": "m", **fields()})
    count = caught.value.error_count()
    assert count <= 2, f"the body should be refused with one error (two for a union), got {count}"


class CountingTokenizer:
    """A Hugging Face tokenizer that records how many characters each call tokenizes."""

    def __init__(self, hf):
        self.hf, self.chars = hf, []

    def __call__(self, text, **options):
        self.chars.append(len(text))
        return self.hf(text, **options)

    def __getattr__(self, name):
        return getattr(self.hf, name)


def test_a_prompt_past_the_context_is_refused_before_it_is_all_tokenized(default_model_dir):
    """660,000 CJK characters pass the API server's cap on characters (the context x the longest
    token) but make 1.8 million tokens: tokenized whole, 2 s of the single tokenizer's time, every
    other request waiting. Counted a window at a time, it passes the context in its first window.
    A text that fits, even one near the context, is still tokenized whole, to the same ids."""
    context = 8192
    manager = TokenizerManager(Tokenizer(default_model_dir), context)
    counting = manager.tokenizer.hf = CountingTokenizer(manager.tokenizer.hf)
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(660_000))
    with pytest.raises(PromptError) as caught:
        manager.tokenize(GenerateReqInput("cjk", SamplingParams(), text=cjk))
    assert sum(counting.chars) <= 2 * context, (
        f"refusing a prompt that passes the context in its first window of {context} characters tokenized "
        f"{sum(counting.chars)} characters of its {len(cjk)}"
    )
    assert caught.value.code == "context_length_exceeded" and str(context) in str(caught.value), caught.value
    english = (REPO / "solutions" / "s09_zmq_serving" / "README.md").read_text()
    near = english[: len(english) * (context - 40) // len(counting.hf(english)["input_ids"])]
    whole = manager.tokenizer.encode(near)
    assert context - 200 < len(whole) <= context, f"the test's text should make nearly {context} tokens: {len(whole)}"
    counting.chars.clear()
    ids = manager.tokenize(GenerateReqInput("near", SamplingParams(), text=near)).input_ids
    assert ids == whole, "a prompt that fits must be tokenized whole, to the same ids as before"
    assert len(counting.chars) > 2, f"a text of {len(near)} characters should have been counted a window at a time"


def test_a_chat_past_the_context_is_refused_before_it_is_all_tokenized(default_model_dir):
    """The same for messages: the chat template's text is counted a window at a time before it is
    tokenized (the text rendered once, for both)."""
    context = 8192
    manager = TokenizerManager(Tokenizer(default_model_dir), context)
    counting = manager.tokenizer.hf = CountingTokenizer(manager.tokenizer.hf)
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(660_000))
    with pytest.raises(PromptError) as caught:
        manager.tokenize(GenerateReqInput("cjk", SamplingParams(), messages=[{"role": "user", "content": cjk}]))
    assert sum(counting.chars) <= 2 * context, (
        f"refusing messages that pass the context in the first window of {context} characters tokenized "
        f"{sum(counting.chars)} characters of their {len(cjk)}"
    )
    assert caught.value.param == "messages" and caught.value.code == "context_length_exceeded", caught.value
