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

from s00_foundation.device import host_to_device

from .penalties import apply_penalties, count_sampled
from .req import Req


def top_k_mask(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``top_k[i]`` most likely tokens of row ``i`` (``-1``: keep all).

    probs: [B, V] float; top_k: [B] int. Returns a [B, V] bool mask of the kept tokens. Ties
    at the boundary are broken by the sort, so exactly k tokens are kept.
    """
    # BEGIN EXERCISE: top-k: keep the k most likely tokens of each row [#the-sampler-logits-b-v--one-token-per-row]
    vocab = probs.shape[-1]
    k = torch.where(top_k < 1, vocab, top_k).clamp(max=vocab).to(probs.device)
    order = probs.argsort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device).expand_as(probs)
    keep_sorted = rank < k[:, None]  # the first k places of each sorted row
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    # END EXERCISE


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities add up to >= top_p.

    A token is kept when the tokens more likely than it hold less than top_p of the mass, so
    the most likely token is always kept. top_p = 1 keeps the whole row. Returns [B, V] bool.
    """
    # BEGIN EXERCISE: top-p: keep the smallest set of likeliest tokens whose mass reaches top_p
    # [#the-sampler-logits-b-v--one-token-per-row]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the strictly more likely tokens
    top_p = top_p.to(probs.device, probs.dtype)[:, None]
    # top_p == 1 means "off": keep everything, even where rounding makes the sum exceed 1.
    keep_sorted = (mass_before < top_p) | (top_p >= 1)
    # The likeliest token always stays, even for a top_p too small for float32 (1e-320 becomes
    # 0.0, and then "mass_before < top_p" keeps nothing, and the draw would fall past the vocabulary).
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    # END EXERCISE


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens at least ``min_p`` times as likely as the most likely token of their row.

    min_p = 0 keeps every token. Returns [B, V] bool.
    """
    # BEGIN EXERCISE: min-p: keep tokens with p >= min_p times the row's largest p
    # [#the-sampler-logits-b-v--one-token-per-row]
    p_max = probs.max(dim=-1, keepdim=True).values
    return probs >= min_p.to(probs.device, probs.dtype)[:, None] * p_max
    # END EXERCISE


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
    params = [req.sampling_params for req in reqs]
    # BEGIN EXERCISE: one token per row: greedy, or temperature, masks and one draw per request
    # [#the-sampler-logits-b-v--one-token-per-row]
    greedy = [p.is_greedy for p in params]
    # max(dim).indices is argmax (the first largest entry of each row), about 2.5x faster on a CPU
    argmax = logits.max(dim=-1).indices
    if all(greedy):
        return argmax  # the fast path: no softmax, no randomness

    device = logits.device
    # Each per-row setting goes to the device with host_to_device (s00 device.py): on a GPU,
    # torch.tensor(..., device=device) would stop the host until the forward has run, every time.
    # Greedy rows get temperature 1 here only to keep the arithmetic finite; their sampled
    # token is replaced by the argmax at the end.
    temperature = host_to_device([1.0 if p.is_greedy else p.temperature for p in params], device, torch.float32)
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)

    keep = torch.ones_like(probs, dtype=torch.bool)
    if any(p.top_k != -1 for p in params):
        keep &= top_k_mask(probs, host_to_device([p.top_k for p in params], device, torch.int64))
    if any(p.top_p < 1 for p in params):
        keep &= top_p_mask(probs, host_to_device([p.top_p for p in params], device, torch.float32))
    if any(p.min_p > 0 for p in params):
        keep &= min_p_mask(probs, host_to_device([p.min_p for p in params], device, torch.float32))
    probs = probs * keep

    # Inverse-CDF sampling: one uniform number u in [0, 1) per row, from the request's own
    # generator; the token is the first whose running total of probability exceeds
    # u * (kept mass). A token of probability 0 adds nothing to the running total, so it can
    # never be the first to exceed anything. (u is float32, so u <= 1 - 2**-24 and the target
    # stays clearly below the float64 total: some token is always found.) Greedy rows draw
    # nothing, so a request's random stream advances only on the steps where it samples.
    u = torch.cat(
        [
            torch.zeros(1) if is_greedy else torch.rand(1, generator=req.generator)
            for is_greedy, req in zip(greedy, reqs)
        ]
    )
    cdf = probs.double().cumsum(dim=-1)
    target = host_to_device(u, device, torch.float64)[:, None] * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return torch.where(host_to_device(greedy, device, torch.bool), argmax, sampled)
    # END EXERCISE


def sample_with_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """What every engine's step calls: each request's penalties and logit_bias reshape its row
    (penalties.py; ``logits`` itself is left as it is), ``sample`` draws, and the drawn tokens are
    counted for the next step's penalties."""
    token_ids = sample(apply_penalties(logits, reqs), reqs)
    count_sampled(reqs, token_ids)
    return token_ids
