"""``ScheduleBatch``: the requests one forward pass runs, and how they become a ``ForwardBatch``.

SGLang's chain, minus its process boundary::

    Req             one request: its tokens and lengths (stage 2)
    ScheduleBatch   the scheduler's choice for this step: every running request decodes one
                    token, the newly admitted ones prefill (this file)
    ForwardBatch    what the model runs: one flattened ragged row of tokens, their positions,
                    the table rows and the slots their K/V go to (stage 0)

One pass mixes both kinds of rows; each request sends fill_ids[cached_len:device_len]::

    decode rows (one token each)        prefill rows (the uncached rest of fill_ids)
    [ a | b | c | d ]                   [ E0 E1 E2 E3 E4 | F0 F1 ]
    prefix_len = cached_len > 0         prefix_len = what the prefix cache matched (0 here)

The attention backend of stage 4 already handles such a row: it attends each request's new
tokens over that request's own table row, whatever its prefix and extend lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from s00_foundation.forward_batch import ForwardBatch
from s02_request_and_sampling.prompt_logprobs import PromptLogprobRows, with_prompt_rows
from s02_request_and_sampling.req import Req
from s04_paged_kv_pool.allocator import pages_for
from s04_paged_kv_pool.engine import prepare_forward
from s04_paged_kv_pool.memory_pool import PoolExhaustedError
from s04_paged_kv_pool.model_runner import ModelRunner

from .prefix_cache import PrefixCache


def slots_to_extend(req: Req, page_size: int) -> int:
    """Fresh slots the request's next pass takes (whole pages): its positions go from
    cached_len to device_len, and its last page is filled up first."""
    return (pages_for(req.device_len, page_size) - pages_for(req.cached_len, page_size)) * page_size


@dataclass
class ScheduleBatch:
    runner: ModelRunner
    prefix_cache: PrefixCache
    decode_reqs: list[Req] = field(default_factory=list)  # running requests: one new token each
    prefill_reqs: list[Req] = field(default_factory=list)  # admitted this step: their uncached tokens
    # the prompt positions the pass scores for prompt_logprobs (set by prepare_forward)
    prompt_rows: PromptLogprobRows = field(default_factory=PromptLogprobRows)

    @property
    def reqs(self) -> list[Req]:
        """Every request of the pass, in the order of the ForwardBatch's rows (and its logits)."""
        return self.decode_reqs + self.prefill_reqs

    @property
    def prefill_tokens(self) -> int:
        return sum(req.extend_len for req in self.prefill_reqs)

    def alloc_token_slots(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_locs: Sequence[int]
    ) -> torch.Tensor:
        """The allocator's ``alloc_extend``, after asking the prefix cache to give back evictable
        slots if the free ones do not suffice (a no-op until stage 6 caches anything)."""
        allocator, p = self.runner.allocator, self.runner.page_size
        needed = sum(pages_for(s, p) - pages_for(c, p) for c, s in zip(prefix_lens, seq_lens)) * p
        if needed > allocator.available_size():
            self.prefix_cache.evict(needed - allocator.available_size())
        try:
            return allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        except PoolExhaustedError as error:  # retraction or admission promised room that is not there
            raise PoolExhaustedError(
                f"{error}. The scheduler let this pass in without the room for it: retract_for_decode and "
                f"admit_new_requests count each pass in whole pages of {p} (slots_to_extend, pages_for, not tokens), "
                "and admission keeps back (reserved) what the requests already in the pass need"
            ) from None

    def prepare_forward(self) -> ForwardBatch:
        """The ForwardBatch of this step: stage 4's prepare_forward over every request (decode
        rows first), with slots allocated through the prefix cache's eviction, asking for the
        logits of the prompt positions it scores (``prompt_rows``)."""
        batch = prepare_forward(self.runner, self.reqs, self.alloc_token_slots)
        self.prompt_rows = with_prompt_rows(batch, self.reqs)
        return batch
