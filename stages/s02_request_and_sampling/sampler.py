"""From a batch of next-token logits to one token per request.

For each row: divide the logits by the request's temperature, turn them into probabilities,
keep only the tokens that top-k, top-p and min-p all allow, and draw one of the kept tokens
in proportion to its probability, using that request's own random generator.

The three filters each look at the same temperature-scaled distribution and return the set
of tokens they keep (a boolean mask), so each can be tested on its own; a token survives if
all three keep it (SGLang's PyTorch sampler does the same). Every filter keeps at least the
most likely token, so there is always something to draw.

Greedy requests (temperature 0 or top_k 1) skip all of it: argmax of the raw logits, exact,
with no softmax to spend time on or to round ties differently.
"""

from __future__ import annotations

from typing import Sequence

import torch

from s00_foundation.device import host_to_device  # noqa: F401

from .penalties import apply_penalties, count_sampled
from .req import Req


def top_k_mask(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``top_k[i]`` most likely tokens of row ``i`` (``-1``: keep all).

    probs: [B, V] float; top_k: [B] int. Returns a [B, V] bool mask of the kept tokens. Ties
    at the boundary are broken by the sort, so exactly k tokens are kept.
    """
    raise NotImplementedError(
        "Stage 2: top-k: keep the k most likely tokens of each row - see stages/s02_request_and_sampling/README.md#the-sampler-logits-b-v--one-token-per-row"  # noqa: E501 (one message, the learner's to read whole)
    )


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to >= top_p.

    A token is kept when the tokens more likely than it hold less than top_p of the mass, so
    the most likely token is always kept. top_p = 1 keeps the whole row. Returns [B, V] bool.
    """
    raise NotImplementedError(
        "Stage 2: top-p: keep the smallest set of likeliest tokens whose mass reaches top_p - see stages/s02_request_and_sampling/README.md#the-sampler-logits-b-v--one-token-per-row"  # noqa: E501 (one message, the learner's to read whole)
    )


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens at least ``min_p`` times as likely as the most likely token of their row.

    min_p = 0 keeps every token. Returns [B, V] bool.
    """
    raise NotImplementedError(
        "Stage 2: min-p: keep tokens with p >= min_p times the row's largest p - see stages/s02_request_and_sampling/README.md#the-sampler-logits-b-v--one-token-per-row"  # noqa: E501 (one message, the learner's to read whole)
    )


def sample(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """One next token per request: logits [B, V] (row i belongs to reqs[i]) -> [B] int64.

    Each row is drawn with its own request's generator, so a request's tokens depend on its
    seed alone, not on the other requests in the batch.
    """
    if logits.dim() != 2 or logits.shape[0] != len(reqs):
        raise ValueError(
            f"logits must be [batch, vocab] with one row per request; got {tuple(logits.shape)} for {len(reqs)} "
            "requests"
        )
    params = [req.sampling_params for req in reqs]  # noqa: F841
    raise NotImplementedError(
        "Stage 2: one token per row: greedy, or temperature, masks and one draw per request - see stages/s02_request_and_sampling/README.md#the-sampler-logits-b-v--one-token-per-row"  # noqa: E501 (one message, the learner's to read whole)
    )


def sample_with_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """What every engine's step calls: each request's penalties and logit_bias reshape its row
    (penalties.py; ``logits`` itself is left as it is), ``sample`` draws, and the drawn tokens are
    counted for the next step's penalties."""
    token_ids = sample(apply_penalties(logits, reqs), reqs)
    count_sampled(reqs, token_ids)
    return token_ids
