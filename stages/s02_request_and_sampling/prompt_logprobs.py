"""Prompt log-probabilities: how likely the model found the prompt itself.

``SamplingParams(prompt_logprobs=k)`` asks, for every prompt token after the first, its
log-probability given the tokens before it and the ``k`` likeliest tokens at its place (vLLM's
``prompt_logprobs``, SGLang's input token logprobs, what OpenAI's legacy ``echo`` with
``logprobs`` returned). It is how a text is scored: an evaluation harness sums a continuation's
entries to compare answers, a perplexity is the mean of them all. The first token has none:
nothing comes before it (``GenerateOutput.prompt_logprobs[0]`` is None).

They cost no extra pass. The prefill already computes a hidden state at every prompt position,
and the logits at position p are the distribution of token p + 1; an engine only ever projects
each request's last position onto the vocabulary because that is the one it samples from. For a
request that asked, the pass returns its prompt positions' rows too
(``ForwardBatch.extra_logit_rows``, after every request's last row), and each is read as an
output token's is (``logprobs.logprob_entries``: the raw logits' float32 log_softmax)::

    prompt        p0    p1    p2    p3          a pass computes positions 0..3
    logits at     0     1     2     3           row 3 (the last) samples the first output token
    scores        p1    p2    p3    (output)    rows 0..2 are the extra rows: 3 prompt entries

Two things every engine must get right:

- A prompt computed over several passes (stage 7's chunks; again after a retraction) is scored
  once per position and in order: the next position to score is ``req.scored_len``, moved on
  when a pass is planned (under stage 10's overlap the entries arrive a step later).
- A cached prefix (stage 6's radix tree) has no logits: another request stored its K/V. So a
  request still scoring its prompt takes at most the positions it already scored from the cache
  (``Req.max_prefix_len``) and computes the rest again, as vLLM and SGLang do for such requests.

Memory: one float32 row of the vocabulary per scored position, for one pass's positions at a
time (a 2048-token chunk of SmolLM2's 49,152-token vocabulary is 400 MB): stage 7's
``chunked_prefill_size`` bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from s00_foundation.forward_batch import ForwardBatch, ForwardMode

from .logprobs import TokenLogprob, logprob_entries

if TYPE_CHECKING:  # only types: req.py imports logprobs.py, not this module
    from .req import Req


@dataclass
class PromptLogprobRows:
    """The prompt positions one pass scores, in order: each one's row in the pass's ragged [T],
    the prompt token its logits score (the next one), and whose it is."""

    num_reqs: int = 0  # requests in the pass: its logits' first rows are their last positions'
    rows: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    reqs: list[Req] = field(default_factory=list)

    @property
    def top_ks(self) -> list[int | None]:
        return [req.sampling_params.prompt_logprobs for req in self.reqs]


def prompt_logprob_rows(reqs: Sequence[Req]) -> PromptLogprobRows:
    """What a pass in which ``reqs[i]`` sends fill_ids[cached_len:device_len] (in this order, one
    ragged row) scores: the positions of each asking request's prompt it has not scored yet whose
    next token is still a prompt token. Each such request's ``scored_len`` moves past them."""
    plan = PromptLogprobRows(num_reqs=len(reqs))
    offset = 0  # where the request's tokens start in the pass's row
    for req in reqs:
        last = len(req.origin_input_ids) - 1  # (the last prompt position scores the first output token)
        if req.sampling_params.prompt_logprobs is not None and req.scored_len < last:
            if req.cached_len > req.scored_len:
                raise RuntimeError(
                    f"request {req.rid} asked for prompt_logprobs but positions {req.scored_len}..{req.cached_len - 1} "
                    "of its prompt came from the prefix cache and have no logits: a prefix match must stop at "
                    f"req.max_prefix_len ({req.max_prefix_len})"
                )
            end = min(req.device_len, last)
            for position in range(req.scored_len, end):
                plan.rows.append(offset + position - req.cached_len)
                plan.token_ids.append(req.origin_input_ids[position + 1])
                plan.reqs.append(req)
            req.scored_len = max(req.scored_len, end)
        offset += req.extend_len
    return plan


def with_prompt_rows(batch: ForwardBatch, reqs: Sequence[Req]) -> PromptLogprobRows:
    """Plan the pass's prompt rows (``prompt_logprob_rows``) and ask ``batch`` for their logits.
    A pass that scores prompt positions is no pure decode, even when every request sends one token
    (a one-token chunk): it runs as an EXTEND, never as stage 8's decode graph, whose output holds
    one row per request."""
    plan = prompt_logprob_rows(reqs)
    batch.extra_logit_rows = plan.rows
    if plan.rows and batch.forward_mode is ForwardMode.DECODE:
        batch.forward_mode = ForwardMode.EXTEND
    return plan


def read_prompt_rows(plan: PromptLogprobRows, logits: torch.Tensor) -> tuple[torch.Tensor, list[TokenLogprob]]:
    """Split a pass's logits planned by ``with_prompt_rows``: the rows the sampler reads
    (``[num_reqs, vocab]``, each request's last position) and the plan's prompt entries."""
    num_reqs = plan.num_reqs
    if logits.shape[0] != num_reqs + len(plan.rows):
        raise RuntimeError(
            f"the pass returned {logits.shape[0]} rows of logits; expected {num_reqs} (each request's last "
            f"position) + {len(plan.rows)} (the prompt positions in ForwardBatch.extra_logit_rows)"
        )
    if not plan.rows:
        return logits, []
    entries = logprob_entries(logits[num_reqs:], plan.token_ids, plan.top_ks)
    return logits[:num_reqs], [entry for entry in entries if entry is not None]  # (every row asked: none is None)


def attach_prompt_entries(plan: PromptLogprobRows, entries: Sequence[TokenLogprob]) -> None:
    """Each entry to its request, in prompt order (under overlap, when the step is processed)."""
    for req, entry in zip(plan.reqs, entries):
        req.prompt_logprobs.append(entry)


def score_prompts(plan: PromptLogprobRows, logits: torch.Tensor) -> torch.Tensor:
    """After a pass planned by ``with_prompt_rows``: attach its prompt entries to their requests
    and return the rows the sampler reads (``read_prompt_rows``)."""
    logits, entries = read_prompt_rows(plan, logits)
    attach_prompt_entries(plan, entries)
    return logits
