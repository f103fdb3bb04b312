"""Offline generation with requests, sampling and a KV cache per request.

The same ``generate(model, tokenizer, prompts, sampling_params)`` as stage 2, but each step
sends only what a request's cache lacks. That is exactly what ``Req``'s lengths describe:

    fill_ids[cached_len:device_len]   the tokens this pass must compute (extend_len of them)

The first pass of a request is its prefill (cached_len = 0, the whole prompt); after each pass
cached_len = device_len, and ``append_token`` moves device_len one further, so every later
pass is a one-token decode. All running requests go through ONE forward pass per step (a ragged
batch of their new tokens, no padding), each with its own cache.
"""

from __future__ import annotations

from typing import Sequence

import torch

from s00_foundation.tokenizer import Tokenizer
from s02_request_and_sampling.engine import (  # noqa: F401
    GenerateOutput,
    PromptInput,
    append_sampled,
    check_not_stuck,
    make_output,
    make_reqs,
)
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams

from .generate import extend  # noqa: F401
from .kv_cache import KVCache


def forward_step(model: torch.nn.Module, reqs: Sequence[Req], caches: Sequence[KVCache]) -> None:
    """One forward pass for all ``reqs`` (caches[i] is reqs[i]'s cache): each sends what its
    cache lacks, then takes one sampled token."""
    raise NotImplementedError(
        "Stage 3: one cached step: extend every request's cache, sample, append - see stages/s03_kv_cache/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
    )


def generate(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompts: PromptInput | Sequence[PromptInput],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
) -> list[GenerateOutput]:
    """Generate a continuation for every prompt; outputs come back in the prompts' order
    (same arguments as stage 2's ``generate``)."""
    reqs = make_reqs(tokenizer, prompts, sampling_params, model.config.vocab_size)
    for req in reqs:
        if req.sampling_params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs: stage 3's engine does not score prompts (its extend returns only each request's "
                "last logits); stage 2's engine does, and every engine from stage 4 on"
            )
    # Preallocated: every position but the last generated token's can be written.
    cache_of = {
        req.rid: KVCache.for_model(model, capacity=len(req.origin_input_ids) + req.sampling_params.max_new_tokens - 1)
        for req in reqs
    }
    running = list(reqs)
    with torch.inference_mode():
        while running:
            forward_step(model, running, [cache_of[req.rid] for req in running])
            check_not_stuck(running)
            running = [req for req in running if not req.finished]
    return [make_output(req) for req in reqs]
