"""Penalties, logit_bias and min_new_tokens: the next token's logits reshaped by what the request
already said.

Five knobs of ``SamplingParams``, each the request's own, applied to its row of raw logits
before the sampler sees them (so greedy picks the best *penalised* token, and the temperature
and the filters work on the penalised distribution):

    repetition_penalty r   every token in the prompt or the output so far: its logit is divided
                           by r when positive and multiplied by r when negative, so for r > 1 it
                           becomes less likely either way (dividing a negative logit would make
                           it MORE likely). CTRL's penalty; transformers' ``repetition_penalty``.
    frequency_penalty f    logit - f * (times the token is in the output so far)     (OpenAI)
    presence_penalty p     logit - p * (1 if the token is in the output so far)      (OpenAI)
    logit_bias {t: b}      logit + b for token t: -100 bans it, +100 all but forces it (OpenAI)
    min_new_tokens n       until n tokens are out, the tokens that would end the request (its
                           stop_token_ids, and EOS unless ignore_eos) are -inf: it cannot stop
                           early, whatever the bias says (transformers' and SGLang's; vLLM's
                           min_tokens). Stop strings still end it, as in both.

In that order: the multiplicative penalty on the model's own logits, then the additive ones,
then the ban, which nothing after it can lift. Frequency and presence count the output only
(OpenAI's definition: a prompt that names a word does not discourage the answer from using it);
the repetition penalty looks at the prompt too, as transformers' does.

Where the history lives: beside the logits, as one row of counts over the vocabulary per request
(``PenaltyState``, on ``req.penalty_state``), kept by whoever samples: ``count_sampled`` adds the
tokens just drawn (and counts the draws on the host, for min_new_tokens). Nothing is rebuilt from
``output_ids``: under overlap (stage 10) the worker samples step N+1 before the scheduler has even
seen step N's token, so only the sampler knows every token drawn so far. (SGLang keeps the same
counts per batch, in its penalizer orchestrator.)

The log-probabilities (logprobs.py) stay the model's own: they are read from the logits before
any of this, and ``apply_penalties`` never changes the tensor it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from s00_foundation.device import host_to_device  # noqa: F401

if TYPE_CHECKING:  # only types: req.py imports this module
    from .req import Req


class PenaltyState:
    """One request's history as its penalties need it, on the logits' device: made at its first
    draw (when it has no output yet) and then only ever touched by the sampler."""

    def __init__(self, req: Req, vocab: int, device: torch.device):
        params = req.sampling_params
        # float32 counts: the frequency penalty multiplies them, and [V] floats are what a GPU adds in one op
        self.output_counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.in_prompt: torch.Tensor | None = None  # [V] bool, only for a repetition penalty
        if params.repetition_penalty != 1:
            prompt = torch.tensor(req.origin_input_ids, device=device)  # ids < vocab (check_fits_the_vocabulary)
            self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, prompt, True)
        self.bias: torch.Tensor | None = None  # [V] float32, only with a logit_bias
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=device)
            values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
            self.bias = torch.zeros(vocab, dtype=torch.float32, device=device).index_put_((ids,), values)
        self.drawn = 0  # tokens the sampler drew for it: a host int, so min_new_tokens never reads the device
        self.stop_ids: torch.Tensor | None = None  # only for a min_new_tokens: the ids it bans until then
        if params.min_new_tokens > 0:
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(req.eos_token_ids))
            ends = {t for t in ends if t < vocab}  # a stop id past the logits can never be drawn
            if ends and len(ends) < vocab:  # (when every token would end it, banning them all leaves nothing to draw)
                self.stop_ids = torch.tensor(sorted(ends), dtype=torch.long, device=device)


def penalty_state(req: Req, logits: torch.Tensor) -> PenaltyState:
    """``req``'s PenaltyState, made on the first call (sized and placed like ``logits``' rows)."""
    if req.penalty_state is None:
        req.penalty_state = PenaltyState(req, logits.shape[-1], logits.device)
    return req.penalty_state


def _stack(rows: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """The rows as one [R, V] tensor, a row of zeros (False) where a request has none."""
    return torch.stack([row if row is not None else torch.zeros_like(like) for row in rows])


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """``logits`` ([B, V], row i is reqs[i]'s) with each request's penalties and logit_bias applied:
    a new float32 tensor, or ``logits`` itself when no request has any. Rows of requests without
    penalties are left as they are."""
    rows = [i for i, req in enumerate(reqs) if req.sampling_params.has_penalties]
    if not rows:
        return logits
    states = [penalty_state(reqs[i], logits) for i in rows]  # noqa: F841
    params = [reqs[i].sampling_params for i in rows]  # noqa: F841
    device = logits.device  # per-row values reach it by host_to_device(values, device, dtype): no host wait  # noqa: F841
    raise NotImplementedError(
        "Stage 2: repetition (prompt, output), frequency and presence (output), the bias, min_new_tokens' ban - see stages/s02_request_and_sampling/README.md#penalties-what-the-request-already-said"  # noqa: E501 (one message, the learner's to read whole)
    )


def count_sampled(reqs: Sequence[Req], token_ids: torch.Tensor) -> None:
    """Add each penalised request's new token (``token_ids[i]`` is reqs[i]'s, on the logits'
    device) to its counts, for the next step's penalties, and count the draw. No value comes to
    the host, and a step without penalised requests does nothing (this runs after every draw of
    every engine)."""
    penalised = [i for i, req in enumerate(reqs) if req.penalty_state is not None]
    if not penalised:
        return
    one = torch.ones(1, device=token_ids.device)
    for i in penalised:
        state = reqs[i].penalty_state
        state.output_counts.index_add_(0, token_ids[i : i + 1], one)
        state.drawn += 1
