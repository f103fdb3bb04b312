"""Offline generation with requests and sampling: ``generate(model, tokenizer, prompts, params)``.

Each prompt becomes a ``Req``. Every step, each running request's next-token logits are
computed the naive way (stage 1's ``next_token_logits``: the whole sequence again), the rows
are stacked into one [B, V] batch for a single ``sample`` call, and each request takes its
token and checks whether it is done. Finished requests leave the batch; the rest go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch

from s00_foundation.attention import NoCacheBackend
from s00_foundation.forward_batch import ForwardBatch
from s00_foundation.tokenizer import Messages, Tokenizer
from s01_naive_generate.generate import next_token_logits

from .logprobs import TokenLogprob, token_logprobs
from .prompt_logprobs import prompt_logprob_rows, score_prompts
from .req import FinishReason, Req
from .sampler import sample_with_penalties
from .sampling_params import SamplingParams

# A prompt is text, chat messages, or token ids that are used as they are.
PromptInput = Union[str, Messages, Sequence[int]]


@dataclass
class GenerateOutput:
    text: str  # trimmed before the stop string / stop token that ended it ("" without a tokenizer)
    output_ids: list[int]  # every generated token, including a matched stop token / EOS
    finish_reason: FinishReason
    prompt_tokens: int
    output_tokens: int
    seed: int  # pass it back in SamplingParams(seed=...) to get this exact output again
    logprobs: list[TokenLogprob] | None  # one per output id when SamplingParams.logprobs was set, else None
    # one per prompt id when SamplingParams.prompt_logprobs was set (the first None: nothing precedes it), else None
    prompt_logprobs: list[TokenLogprob | None] | None


def encode(tokenizer: Tokenizer | None, prompt: PromptInput) -> list[int]:
    """A prompt's token ids: text and chat messages through the tokenizer, token ids as they are."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    else:
        items = list(prompt)  # checked item by item below
    if isinstance(prompt, str) or (items and all(isinstance(m, dict) for m in items)):
        if tokenizer is None:
            raise ValueError(f"this engine has no tokenizer, so prompts must be token ids; got {prompt!r:.60}")
        return tokenizer.encode_prompt(prompt if isinstance(prompt, str) else items)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return items
    raise ValueError(
        f"each prompt must be a string, a non-empty list of chat messages ({{'role': ..., 'content': ...}}) "
        f"or a non-empty list of token ids; got {prompt!r:.80}"
    )


def check_fits_the_vocabulary(ids: Sequence[int], params: SamplingParams, vocab_size: int) -> None:
    """What only the model can tell about a request: every prompt id must have a row in its
    embedding (one beyond it fails deep inside the forward pass, as "index out of range"), top_k
    must be at most the vocabulary (a larger one asks for more tokens than there are, and past
    2**63 would not even fit the sampler's int64 tensor), and so must logit_bias's token ids (each
    one is a column of the logits)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary), got {bad[:5]}")
    bad = [t for t in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}) (the vocabulary), got {bad[:5]}")
    if params.top_k > vocab_size:
        raise ValueError(f"top_k must be -1 (off) or in [1, {vocab_size}] (the vocabulary), got {params.top_k}")


def pair_prompts_with_params(
    prompts: PromptInput | Sequence[PromptInput],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
) -> list[tuple[PromptInput, SamplingParams]]:
    """Each prompt with its SamplingParams. ``prompts`` is a list of prompts (a single string is
    accepted as a list of one); ``sampling_params`` is one SamplingParams for all of them (None:
    the defaults) or one per prompt."""
    listed: list[Any] = [prompts] if isinstance(prompts, str) else list(prompts)  # encode() checks each
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(listed)
    sampling_params = list(sampling_params)
    if len(sampling_params) != len(listed):
        raise ValueError(
            f"got {len(listed)} prompts but {len(sampling_params)} SamplingParams; pass one, or one per prompt"
        )
    return list(zip(listed, sampling_params))


def make_reqs(
    tokenizer: Tokenizer,
    prompts: PromptInput | Sequence[PromptInput],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    vocab_size: int | None = None,
) -> list[Req]:
    """One ``Req`` per prompt (rid = its index), paired with its SamplingParams as
    ``pair_prompts_with_params`` says. With the model's ``vocab_size`` (the engines pass it),
    raises ValueError for a prompt the model cannot take (``check_fits_the_vocabulary``)."""
    reqs = []
    for i, (prompt, params) in enumerate(pair_prompts_with_params(prompts, sampling_params)):
        ids = encode(tokenizer, prompt)
        if vocab_size is not None:
            check_fits_the_vocabulary(ids, params, vocab_size)
        reqs.append(Req(rid=i, origin_input_ids=ids, sampling_params=params, tokenizer=tokenizer))
    return reqs


def make_output(req: Req) -> GenerateOutput:
    return GenerateOutput(
        text=req.output_text if req.tokenizer is not None else "",
        output_ids=list(req.output_ids),
        finish_reason=req.finished_reason,
        prompt_tokens=len(req.origin_input_ids),
        output_tokens=len(req.output_ids),
        seed=req.seed,
        logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
        prompt_logprobs=[None, *req.prompt_logprobs] if req.sampling_params.prompt_logprobs is not None else None,
    )


def append_sampled(reqs: Sequence[Req], logits: torch.Tensor) -> None:
    """Each request samples its next token from its row of ``logits`` ([B, V], row i is
    reqs[i]'s), appends it with its log-probabilities (those who asked), and checks whether it
    is done. Every engine's step ends here, from this stage's to stage 7's scheduler."""
    token_ids = sample_with_penalties(logits, reqs)
    for req, token_id, logprob in zip(reqs, token_ids.tolist(), token_logprobs(logits, token_ids, reqs)):
        req.append_token(token_id, logprob)
        req.check_finished()


def check_not_stuck(reqs: Sequence[Req]) -> None:
    """A request at max_new_tokens must be finished; without this guard a check_finished that
    never ends a request would hang the generation loop."""
    for req in reqs:
        if not req.finished and len(req.output_ids) >= req.sampling_params.max_new_tokens:
            raise RuntimeError(
                f"request {req.rid} has max_new_tokens={req.sampling_params.max_new_tokens} "
                f"tokens but check_finished() did not finish it (expected finish reason 'length')"
            )


def next_logits(model: torch.nn.Module, req: Req) -> torch.Tensor:
    """``req``'s next-token logits ``[vocab]``, computed from scratch (stage 1's
    ``next_token_logits``); a request that asked for its prompt's log-probabilities gets them
    from its first pass, which returns its prompt positions' logits too (prompt_logprobs.py)."""
    plan = prompt_logprob_rows([req])
    if not plan.rows:
        return next_token_logits(model, req.fill_ids)
    batch = ForwardBatch.build([req.fill_ids], [0], NoCacheBackend(), device=model.device, extra_logit_rows=plan.rows)
    return score_prompts(plan, model(batch))[0]


def generate(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompts: PromptInput | Sequence[PromptInput],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
) -> list[GenerateOutput]:
    """Generate a continuation for every prompt; outputs come back in the prompts' order.

    ``prompts`` is a list of prompts (a single string is accepted as a list of one);
    ``sampling_params`` is one SamplingParams for all of them or one per prompt.
    """
    reqs = make_reqs(tokenizer, prompts, sampling_params, model.config.vocab_size)
    running = list(reqs)
    with torch.inference_mode():
        while running:
            # Nothing is cached in this stage, so each pass recomputes all of fill_ids
            # (cached_len is 0 and extend_len == device_len == len(fill_ids)).
            logits = torch.stack([next_logits(model, req) for req in running])
            append_sampled(running, logits)
            check_not_stuck(running)
            running = [req for req in running if not req.finished]
    return [make_output(req) for req in reqs]
