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
    raise NotImplementedError(
        "Stage 11: unpack the bits and mask the forbidden tokens - see stages/s11_structured_output/README.md#the-bitmask"  # noqa: E501 (one message, the learner's to read whole)
    )


class GrammarWorker(OverlapWorker):
    """Stage 10's worker; its sampler masks the rows of constrained requests first."""

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
        if not rows:  # a step of free requests only: stage 2's sampler, untouched
            return super().sample(logits, reqs)
        raise NotImplementedError(
            "Stage 11: fill each constrained row's bitmask, mask those logits, then sample - see stages/s11_structured_output/README.md#the-bitmask"  # noqa: E501 (one message, the learner's to read whole)
        )
