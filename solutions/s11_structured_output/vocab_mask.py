"""The token bitmask, applied where the logits are: ``apply_token_bitmask`` and ``GrammarWorker``
(and ``allocate_token_bitmask``, the all-allowed mask they start from).

Before a constrained request samples, its grammar writes which tokens may come next into one row
of a bitmask (int32 words, bit j of word w = token 32*w + j). The forbidden tokens' logits become
-inf BEFORE the sampler divides by the temperature and cuts by top-k/top-p/min-p: then every
probability the sampler computes is already renormalised over the allowed tokens, greedy picks the
best allowed token, and no sampling setting can pick a forbidden one. Stage 2's ``sample`` takes
raw logits, so masking them first is the whole seam; the sampler itself is unchanged.

The mask is filled and applied on the worker, in its ``sample`` (stage 10's seam), after the
forward: grammar state lives beside the full logits (the sampler's side), never in the model's
forward (under tensor parallelism that is rank 0's job).
"""

from __future__ import annotations

import torch

from s02_request_and_sampling.req import Req
from s10_overlap_scheduling.overlap_worker import OverlapWorker


def allocate_token_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """A bitmask of ``rows`` rows with every token allowed: [rows, ceil(vocab / 32)] int32, -1 is
    all 32 bits set. (llguidance.torch has the same function, but that module wraps a kernel in
    torch.compile as it is imported, which imports torch._dynamo: ~2 s at every server start.)"""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[i, t]`` to -inf (in place) wherever bit t of ``bitmask[i]`` is 0.

    logits: [B, V] float; bitmask: [B, W] int32 on the CPU with 32 * W >= V' (the tokenizer's
    tokens). Columns past 32 * W (a vocabulary padded past the tokenizer's ids) are never allowed.
    """
    # BEGIN EXERCISE: unpack the bits and mask the forbidden tokens [#the-bitmask]
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)  # [B, 32W]
    allowed = allowed[:, :vocab]
    if allowed.shape[1] < vocab:  # padded vocabulary: the extra tokens are never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], dim=1)
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
    # END EXERCISE


class GrammarWorker(OverlapWorker):
    """Stage 10's worker; its sampler masks the rows of constrained requests first."""

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
        if not rows:  # a step of free requests only: stage 2's sampler, untouched
            return super().sample(logits, reqs)
        # BEGIN EXERCISE: fill each constrained row's bitmask, mask those logits, then sample [#the-bitmask]
        bitmask = allocate_token_bitmask(len(rows), logits.shape[-1])
        for i, row in enumerate(rows):
            reqs[row].grammar.fill_mask(bitmask, i)
        masked = logits[rows].float()  # a copy: the other rows keep their logits
        apply_token_bitmask(masked, bitmask)
        # a copy too: the caller's logits stay the model's own (log-probabilities are read from them)
        logits = logits.to(torch.float32, copy=True)
        logits[rows] = masked
        return super().sample(logits, reqs)
        # END EXERCISE
