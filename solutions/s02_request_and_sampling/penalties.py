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

from s00_foundation.device import host_to_device

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
    states = [penalty_state(reqs[i], logits) for i in rows]
    params = [reqs[i].sampling_params for i in rows]
    device = logits.device  # per-row values reach it by host_to_device(values, device, dtype): no host wait
    # BEGIN EXERCISE: repetition (prompt, output), frequency and presence (output), the bias, min_new_tokens' ban
    # [#penalties-what-the-request-already-said]
    out = logits.to(torch.float32, copy=True)  # a copy: the caller's logits stay the model's own
    x = out[rows]
    # "does any row use it?" is asked of the params: a tensor's answer would wait for the GPU
    repetition = any(p.repetition_penalty != 1 for p in params)
    additive = any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params)
    if repetition or additive:  # both read the output counts ([R, V]: not stacked for a bias or a ban alone)
        counts = torch.stack([s.output_counts for s in states])
        in_output = counts > 0
    if repetition:
        r = host_to_device([p.repetition_penalty for p in params], device, torch.float32)[:, None]
        seen = in_output | _stack([s.in_prompt for s in states], like=in_output[0])
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if additive:
        frequency = host_to_device([p.frequency_penalty for p in params], device, torch.float32)[:, None]
        presence = host_to_device([p.presence_penalty for p in params], device, torch.float32)[:, None]
        x = x - frequency * counts - presence * in_output
    if any(s.bias is not None for s in states):
        x = x + _stack([s.bias for s in states], like=x[0])
    for k, (s, p) in enumerate(zip(states, params)):
        if s.stop_ids is not None and s.drawn < p.min_new_tokens:  # host ints: no GPU sync
            x[k, s.stop_ids] = float("-inf")
    out[rows] = x
    return out
    # END EXERCISE


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
