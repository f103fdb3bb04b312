"""Log-probabilities: how likely the model found each token it produced, and its alternatives.

A client that asks for ``SamplingParams(logprobs=k)`` gets, for every output token, a
``TokenLogprob``: the token's log-probability and the ``k`` most likely tokens at that position
with theirs. That is how a caller scores an answer, spots where the model was guessing, or ranks
candidate continuations (OpenAI's ``logprobs`` / ``top_logprobs``).

Which distribution: the model's own, ``log_softmax`` of the raw logits, before the temperature,
top-k / top-p / min-p or a grammar's mask (stage 11) reshaped it. So a token's log-probability is
the same whichever settings picked it, a greedy and a sampled run agree wherever they chose the
same token, and a token a grammar forced shows how far it was from the model's own choice. It is
what transformers' ``output_logits`` give and vLLM's default ("raw" logprobs); engines that report
the processed distribution instead say so just as explicitly.

Only the rows that asked pay: one ``logsumexp`` per row (in float32: bfloat16 would round the
small probabilities away), a gather at the sampled ids and one ``topk``, each shifted by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:  # only types: req.py imports this module
    from .req import Req


@dataclass(frozen=True)
class TokenLogprob:
    """One output token: its id, its log-probability, and the most likely tokens at its position."""

    token_id: int
    logprob: float  # log p(token | everything before it), <= 0
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the k likeliest, most likely first


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], reqs: Sequence[Req]
) -> list[TokenLogprob | None]:
    """Entry i: ``token_ids[i]``'s TokenLogprob under row i of ``logits`` ([B, V], raw), with the
    ``reqs[i].sampling_params.logprobs`` likeliest tokens; None for a request that did not ask."""
    return logprob_entries(logits, token_ids, [req.sampling_params.logprobs for req in reqs])


def logprob_entries(
    logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], top_ks: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Entry i: ``token_ids[i]``'s TokenLogprob under row i of ``logits`` ([B, V], raw), with the
    ``top_ks[i]`` likeliest tokens; None where ``top_ks[i]`` is None (that row did not ask).
    Output tokens (``token_logprobs``) and prompt tokens (prompt_logprobs.py) are read alike."""
    out: list[TokenLogprob | None] = [None] * len(top_ks)
    rows = [i for i, k in enumerate(top_ks) if k is not None]
    if not rows:  # nobody asked: nothing is computed
        return out
    # BEGIN EXERCISE: each asking row's log_softmax, its token's entry, its top k
    # [#log-probabilities-how-sure-the-model-was]
    x = logits[rows].float() if len(rows) < len(top_ks) else logits.float()  # (every row asked: no copy)
    # log_softmax(x) = x - logsumexp(x): one number per row, not a second [R, V] tensor
    norm = torch.logsumexp(x, dim=-1)
    ids = torch.as_tensor(token_ids, device=logits.device)[rows]
    chosen = x.gather(1, ids[:, None])[:, 0] - norm
    k = max(top_ks[i] for i in rows)
    top_values, top_ids = x.topk(k, dim=-1)
    top_values = top_values - norm[:, None]
    # To the host in ONE read (on a GPU every read waits for the device): per row the token's id and
    # log-probability, the k likeliest ids, their log-probabilities; float64 holds each id and each
    # float32 value exactly.
    table = torch.cat([ids[:, None].double(), chosen[:, None].double(), top_ids.double(), top_values.double()], 1)
    for i, (token, value, *top) in zip(rows, table.tolist()):
        k_i = top_ks[i]
        out[i] = TokenLogprob(int(token), value, tuple(zip(map(int, top[:k_i]), top[k : k + k_i])))
    return out
    # END EXERCISE
