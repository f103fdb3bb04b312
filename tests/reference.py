"""The truth: Hugging Face ``transformers`` on the same weights, and messages that compare to it.

Models and results are cached for the whole test session, so each reference generation runs
once however many tests compare against it.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=8)
def engine_model(path: str, dtype: torch.dtype = torch.float32):
    """The engine's own model (from the tree under test's s00_foundation), loaded once."""
    from s00_foundation.loader import load_model

    return load_model(path, device="cpu", dtype=dtype)


@functools.lru_cache(maxsize=8)
def engine_tokenizer(path: str):
    from s00_foundation.tokenizer import Tokenizer

    return Tokenizer(path)


@functools.lru_cache(maxsize=512)
def _hf_greedy(
    path: str, prompt: tuple[int, ...], max_new_tokens: int, eos: tuple[int, ...], min_new_tokens: int
) -> tuple[int, ...]:
    model = hf_model(path)
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = min_new_tokens or None  # transformers' MinNewTokensLengthLogitsProcessor bans `eos`
    config.eos_token_id = list(eos)  # []: generate until max_new_tokens (None would mean "the model's own EOS")
    config.pad_token_id = eos[0] if eos else 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(
    path: str | Path, prompt: Sequence[int], max_new_tokens: int, eos: Sequence[int] = (), min_new_tokens: int = 0
) -> list[int]:
    """transformers' greedy continuation of ``prompt``; stops after an ``eos`` id (kept in the output),
    which it may not draw before ``min_new_tokens`` tokens are out."""
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens, tuple(eos), min_new_tokens))


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties as its documentation defines them: logit
    - frequency * count - presence * (count > 0), counting the output so far (transformers has
    no processor for them; its repetition penalty and sequence bias are used as they are)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@functools.lru_cache(maxsize=256)
def _hf_penalized_greedy(
    path: str,
    prompt: tuple[int, ...],
    max_new_tokens: int,
    repetition: float,
    frequency: float,
    presence: float,
    bias: tuple[tuple[int, float], ...],
) -> tuple[int, ...]:
    model = hf_model(path)
    processors = LogitsProcessorList()
    if repetition != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition))
    if frequency or presence:
        processors.append(OpenAIPenalties(len(prompt), frequency, presence))
    if bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in bias}))
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens, config.eos_token_id, config.pad_token_id = False, max_new_tokens, [], 0
    config.repetition_penalty = 1.0  # only the processors above
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config, logits_processor=processors
        )
    return tuple(out[0, len(prompt) :].tolist())


def hf_penalized_greedy(path: str | Path, prompt: Sequence[int], max_new_tokens: int, params) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (no EOS: max_new_tokens tokens) under
    ``params``' penalties, in the engine's order: transformers' repetition penalty, OpenAI's
    frequency and presence penalties, transformers' sequence bias as logit_bias."""
    bias = tuple(sorted(params.logit_bias.items()))
    return list(
        _hf_penalized_greedy(
            str(path),
            tuple(prompt),
            max_new_tokens,
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
            bias,
        )
    )


def hf_last_logits(path: str | Path, prompt: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(str(path))(torch.tensor([list(prompt)])).logits[0, -1].float()


def assert_same_tokens(got: Sequence[int], expected: Sequence[int], what: str, tokenizer=None) -> None:
    """Fail with the first step where ``got`` leaves ``expected``, in a learner's words."""
    __tracebackhide__ = True  # the failure points at the test's call, not at this helper
    got, expected = list(got), list(expected)
    if got == expected:
        return

    def show(token):
        return f"{token} ({tokenizer.decode([token], skip_special_tokens=False)!r})" if tokenizer else str(token)

    for step, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            raise AssertionError(
                f"{what}: step {step}: your engine produced token {show(g)}, the reference produced "
                f"{show(e)} (the first {step} tokens agreed)"
            )
    common = min(len(got), len(expected))
    if len(got) < len(expected):
        missing = ", ".join(show(token) for token in expected[common : common + 3])
        tail = f"yours stops too early: the reference goes on with {missing}" + (
            " ..." if len(expected) > common + 3 else ""
        )
        if expected[common] in getattr(tokenizer, "eos_token_ids", ()):
            tail += " (an EOS token: the token that ends a request is kept in its output_ids)"
    else:
        tail = f"yours goes on with {show(got[common])}"
    raise AssertionError(
        f"{what}: your engine produced {len(got)} tokens, the reference {len(expected)} (the first {common} agree); "
        f"{tail}"
    )


def hf_logprobs(path: str | Path, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """transformers' log_softmax at each output position: row i is the distribution output[i] was
    drawn from (one forward over prompt + output, in float32)."""
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([[*prompt, *output]])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


LOGPROB_TOLERANCE = 1e-4  # float32 logits of the same model computed two ways (the engine, transformers)


def assert_logprobs_match(path: str | Path, prompt: Sequence[int], output, k: int, what: str) -> None:
    """``output`` (a GenerateOutput of a request with logprobs=k) has one entry per output token,
    each with transformers' logprob of that token and its k likeliest tokens."""
    __tracebackhide__ = True
    entries = output.logprobs
    assert entries is not None and len(entries) == len(output.output_ids), (
        f"{what}: logprobs={k} asks for one entry per output token ({len(output.output_ids)}), got "
        f"{None if entries is None else len(entries)}"
    )
    assert [e.token_id for e in entries] == list(output.output_ids), (
        f"{what}: entry i names output token i: the entries name {[e.token_id for e in entries]}, the output is "
        f"{list(output.output_ids)}"
    )
    expected = hf_logprobs(path, prompt, output.output_ids)
    for i, entry in enumerate(entries):
        want = expected[i, entry.token_id].item()
        assert abs(entry.logprob - want) < LOGPROB_TOLERANCE, (
            f"{what}: output token {i} ({entry.token_id}) has logprob {entry.logprob:.6f}, transformers' "
            f"log_softmax of the raw logits gives {want:.6f}"
        )
        top = expected[i].topk(k).indices.tolist()
        assert [t for t, _ in entry.top] == top, (
            f"{what}: at output token {i} the {k} likeliest tokens are {top} (transformers), the entry lists "
            f"{[t for t, _ in entry.top]}"
        )


def hf_prompt_logprobs(path: str | Path, prompt: Sequence[int]) -> torch.Tensor:
    """transformers' log_softmax at each prompt position but the last: row i is the distribution
    prompt[i + 1] is scored under (one forward over the prompt, in float32)."""
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([list(prompt)])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def assert_prompt_logprobs_match(path: str | Path, prompt: Sequence[int], output, k: int, what: str) -> None:
    """``output`` (a GenerateOutput of a request with prompt_logprobs=k) has one entry per prompt
    token, None for the first, then each with transformers' logprob of that token and its k
    likeliest tokens."""
    __tracebackhide__ = True
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt), (
        f"{what}: prompt_logprobs={k} asks for one entry per prompt token ({len(prompt)}, the first None), got "
        f"{None if entries is None else len(entries)}"
    )
    assert entries[0] is None, f"{what}: the first prompt token has no entry (nothing precedes it), got {entries[0]}"
    named = [e.token_id if e is not None else None for e in entries[1:]]
    assert named == list(prompt[1:]), (
        f"{what}: entry i names prompt token i: the entries name {named}, the prompt is {list(prompt)}"
    )
    expected = hf_prompt_logprobs(path, prompt)
    for i, entry in enumerate(entries[1:], start=1):
        want = expected[i - 1, entry.token_id].item()
        assert abs(entry.logprob - want) < LOGPROB_TOLERANCE, (
            f"{what}: prompt token {i} ({entry.token_id}) has logprob {entry.logprob:.6f}, transformers' "
            f"log_softmax of the logits at position {i - 1} gives {want:.6f}"
        )
        top = expected[i - 1].topk(k).indices.tolist()
        assert [t for t, _ in entry.top] == top, (
            f"{what}: at prompt token {i} the {k} likeliest tokens are {top} (transformers), the entry lists "
            f"{[t for t, _ in entry.top]}"
        )
