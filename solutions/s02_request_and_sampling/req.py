"""One generation request as the engine tracks it: ``Req``, and why it ended: ``FinishReason``.

A request is its prompt, the tokens generated so far, its sampling parameters, its own random
generator and three lengths that every later stage schedules by:

    fill_ids     = origin_input_ids + output_ids     the whole sequence so far
    cached_len   tokens of fill_ids whose K/V are already stored (0 until stage 3's KV cache)
    device_len   tokens of fill_ids the model has seen once the current forward pass is done
    extend_len   = device_len - cached_len           tokens this forward pass must compute

In stage 2 nothing is cached, so every step recomputes the whole sequence (extend_len is
everything). Stage 3 keeps the K/V and sets cached_len = device_len after each pass, so a
decode step computes exactly one token; stage 7 splits a long prompt by moving device_len
forward a chunk at a time.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Iterable, Literal, Sequence

import torch

from .detokenizer import Decoder, IncrementalDetokenizer
from .logprobs import TokenLogprob
from .penalties import PenaltyState
from .sampling_params import SamplingParams

if TYPE_CHECKING:  # only types: stage 2 never imports stage 5 or 11 at run time
    from s05_continuous_batching.prefix_cache import PrefixMatch
    from s11_structured_output.grammar_backend import Grammar

FinishType = Literal["stop", "length", "abort"]


def find_stop_str(text: str, new_len: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that the last ``new_len`` characters of ``text`` completed, and where it
    starts: ``(pos, stop)``, the earliest one when several did; None when none did.

    A stop string that just appeared ends inside the new text, so it starts at most
    (longest stop - 1) characters before it: searching only that window keeps each step O(1)
    however long the text grows. (Stage 9's detokenizer runs the same search.)
    """
    # BEGIN EXERCISE: find the stop string the new text completed, searching only a window
    # [#when-a-request-stops-and-why]
    if not stops or new_len == 0:
        return None
    start = max(0, len(text) - new_len - (max(map(len, stops)) - 1))
    window = text[start:]
    hits = [(window.find(stop), stop) for stop in stops if stop in window]
    if not hits:
        return None
    pos, stop = min(hits, key=lambda hit: hit[0])
    return start + pos, stop
    # END EXERCISE


@dataclass(frozen=True)
class FinishReason:
    # "stop": a stop token/string or EOS matched; "length": max_new_tokens reached;
    # "abort": ended from outside (Req.abort: the client left, or the request cannot be served)
    type: FinishType
    matched: int | str | None = None  # the token id or stop string that matched ("stop" only)

    def __str__(self) -> str:
        return self.type if self.matched is None else f"{self.type} ({self.matched!r})"


@dataclass
class TimeStats:
    """When things happened to one request (the scheduler's clock, seconds; stage 5 fills it)."""

    arrival: float | None = None  # queued (add_request)
    scheduled: list[float] = field(default_factory=list)  # each admission (again after a retraction)
    retracted: list[float] = field(default_factory=list)
    first_token: float | None = None
    finished: float | None = None  # finished or aborted

    def got_token(self, now: float, finished: bool) -> None:
        """A step gave the request a token at ``now``: maybe its first, maybe its last."""
        if self.first_token is None:
            self.first_token = now
        if finished:
            self.finished = now


class Req:
    """One request. Every field is declared here, the ones later stages fill included (each says
    which stage fills it), so a reader and a type checker find them all in one place."""

    def __init__(
        self,
        rid: Hashable,
        origin_input_ids: Iterable[int],
        sampling_params: SamplingParams,
        tokenizer: Decoder | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ):
        self.rid = rid
        self.origin_input_ids: list[int] = list(origin_input_ids)
        if not self.origin_input_ids:
            raise ValueError(f"request {rid}: the prompt has no tokens; a model needs at least one to continue from")
        self.output_ids: list[int] = []
        # One per output token when sampling_params.logprobs is set (whoever samples appends it)
        self.output_logprobs: list[TokenLogprob] = []
        # One per prompt token after the first when sampling_params.prompt_logprobs is set,
        # appended as the passes that compute the prompt score it (prompt_logprobs.py), and how
        # many prompt positions passes were asked to score (ahead of the entries under overlap)
        self.prompt_logprobs: list[TokenLogprob] = []
        self.scored_len = 0
        # The tokens drawn so far as the penalties count them (penalties.py): made and kept by the
        # sampler alone (under stage 10's overlap, on the worker's thread); None without penalties
        self.penalty_state: PenaltyState | None = None
        self.sampling_params = sampling_params
        # The tokenizer turns output ids into text: needed for stop strings and output_text.
        self.tokenizer = tokenizer
        if sampling_params.stop and tokenizer is None:
            raise ValueError(f"request {rid}: stop strings need a tokenizer to read the generated text")
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", [])
        self.eos_token_ids = frozenset(eos_token_ids)

        # The lengths (module docstring): 0 <= cached_len <= device_len <= len(fill_ids).
        self.cached_len = 0  # stage 3 on: set after each pass by whoever stores the K/V
        self.device_len = len(self.origin_input_ids)  # the first pass sees the whole prompt (stage 7 cuts it)
        self.finished_reason: FinishReason | None = None

        # Filled by later stages while the request holds memory; None when it holds none.
        self.req_pool_idx: int | None = None  # stage 4: its row in the request -> slots table
        self.prefix_match: PrefixMatch | None = None  # stage 5: what the prefix cache gave it (locked)
        self.time_stats = TimeStats()  # stage 5: when the scheduler queued, admitted, retracted it
        self.grammar: Grammar | None = None  # stage 11: its place in its grammar, once compiled (None: free)
        self.grammar_error: str | None = None  # stage 11: why it was aborted (no compile, or the library gave up)

        # Every request owns its random stream, so its tokens depend only on its seed, never
        # on which other requests happen to share the batch. Without a seed we draw one and
        # keep it: any sampled run can be reproduced by passing req.seed back in.
        self.seed = sampling_params.seed if sampling_params.seed is not None else secrets.randbits(63)
        # A CPU generator: the sampler draws one uniform number per step from it, which is the
        # same on every device (a CUDA generator would tie the stream to the GPU).
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)

        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop_str_pos: int | None = None  # where the matched stop string starts in the text

    # --- lengths -------------------------------------------------------------------------------

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def max_prefix_len(self) -> int:
        """How many leading tokens of fill_ids a prefix cache may give this request (stage 5 on):
        all but the last, whose logits give the next token; while it still scores its prompt
        (prompt_logprobs), only the positions already scored, since a cached one has no logits."""
        longest = len(self.origin_input_ids) + len(self.output_ids) - 1
        if self.sampling_params.prompt_logprobs is not None and self.scored_len < len(self.origin_input_ids) - 1:
            return min(longest, self.scored_len)
        return longest

    # --- progress ------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Record a sampled token (and its log-probabilities, when the request asked for them);
        the next forward pass must see it too, so device_len grows.

        cached_len is left alone: whether the K/V of the tokens just processed were kept is the
        cache's business (stage 3 sets cached_len = device_len before calling this).
        """
        if self.finished:
            raise RuntimeError(f"request {self.rid} already finished ({self.finished_reason}); it takes no more tokens")
        self.output_ids.append(int(token_id))
        if logprob is not None:
            self.output_logprobs.append(logprob)
        self.device_len += 1

    def check_finished(self) -> None:
        """Decide, after the newest output token, whether the request is done, and why.

        Order: a stop token / EOS (unless ignore_eos), then stop strings, then max_new_tokens.
        """
        if self.finished or not self.output_ids:
            return
        # BEGIN EXERCISE: decide whether the request is done, and why [#when-a-request-stops-and-why]
        params = self.sampling_params
        last = self.output_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            self.finished_reason = FinishReason("stop", matched=last)
            return

        if params.stop:
            new_text = self._detokenizer.step(self.output_ids)
            hit = find_stop_str(self._detokenizer.text, len(new_text), params.stop)
            if hit is not None:
                self._stop_str_pos, stop_str = hit
                self.finished_reason = FinishReason("stop", matched=stop_str)
                return

        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishReason("length")
        # END EXERCISE

    def abort(self) -> None:
        """End the request from outside (a client went away, a prompt too long to serve)."""
        if not self.finished:
            self.finished_reason = FinishReason("abort")

    # --- text ----------------------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """The generated text, without whatever stopped it: a matched stop string and anything
        after it are trimmed, and a matched stop token / EOS is not part of the text."""
        if self.tokenizer is None:
            raise ValueError(f"request {self.rid} has no tokenizer, so it has no text; read output_ids")
        if self._stop_str_pos is not None:
            return self._detokenizer.text[: self._stop_str_pos]
        ids = self.output_ids
        if self.finished_reason is not None and isinstance(self.finished_reason.matched, int):
            ids = ids[:-1]
        return self._detokenizer.flush(ids)

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)} tokens, "
            f"output={len(self.output_ids)} tokens, cached_len={self.cached_len}, "
            f"device_len={self.device_len}, finished_reason={self.finished_reason})"
        )
