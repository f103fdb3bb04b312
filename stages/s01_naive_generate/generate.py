"""Naive greedy generation: every step runs the WHOLE sequence through the model again.

Step t runs all prompt_len + t tokens through every layer: the projections and the MLP cost
grows linearly with that length and attention's quadratically. So N new tokens cost O(N^2) in
matmuls plus O(N^3) in attention; on a small model the matmuls dominate until contexts are long
(notebook 01 measures a step time that grows about linearly). Nothing is remembered between
steps; stage 3 fixes exactly that.
"""

from __future__ import annotations

from typing import Sequence

import torch

from s00_foundation.attention import NoCacheBackend  # noqa: F401
from s00_foundation.forward_batch import ForwardBatch  # noqa: F401
from s00_foundation.model import CausalLM


def next_token_logits(model: CausalLM, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[vocab]`` for the token that follows ``token_ids``, computed from scratch."""
    raise NotImplementedError(
        "Stage 1: the logits of the next token for the whole sequence (one ForwardBatch, nothing cached) - see stages/s01_naive_generate/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
    )


def naive_generate(
    model: CausalLM, input_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
) -> list[int]:
    """Greedy continuation of ``input_ids``: at most ``max_new_tokens`` new ids, ending with
    an EOS id if one was produced (the EOS id is kept, as ``transformers`` does)."""
    if not input_ids:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tokens = list(input_ids)  # noqa: F841
    new_tokens: list[int] = []  # noqa: F841
    raise NotImplementedError(
        "Stage 1: the greedy loop: recompute, pick, append, stop - see stages/s01_naive_generate/README.md#what-you-write"  # noqa: E501 (one message, the learner's to read whole)
    )
