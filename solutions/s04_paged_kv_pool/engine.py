"""A static batch served out of one KV pool: ``StaticBatchEngine`` and ``generate_static_batch``.

"Static" means the batch is fixed when it starts: every request is admitted at once, the pool
must be able to hold all of them at their longest, and no request joins until the batch is
done (stage 5's continuous batching lifts that). Each step is ONE forward pass:

    step 0 (prefill):  [A0 A1 A2 A3 | B0 B1 | C0 C1 C2 C3 C4 C5]   ragged, no padding
    step 1 (decode):   [a | b | c]       one new token per running request
    step 2 (decode):   [a | c]           B finished: its slots and table row went back

Before a pass, every request gets slots for the tokens it sends (allocator.alloc_extend, which
fills the request's last page first) and those slots are written into its req_to_token row;
the attention backend then writes the new K/V into the slots and reads every request's K/V
through its row.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from s00_foundation.forward_batch import ForwardBatch
from s00_foundation.model import CausalLM
from s00_foundation.tokenizer import Tokenizer
from s02_request_and_sampling.engine import (
    GenerateOutput,
    PromptInput,
    append_sampled,
    check_not_stuck,
    make_output,
    make_reqs,
)
from s02_request_and_sampling.prompt_logprobs import score_prompts, with_prompt_rows
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams

from .allocator import pages_for
from .memory_pool import PoolExhaustedError
from .model_runner import ModelRunner

# slot_map() codes for slots that hold no token
FREE, RESERVED, PAGE_TAIL = -1, -2, -3


def max_positions(req: Req) -> int:
    """Positions a request ever stores: all but its last generated token (never fed back)."""
    return len(req.origin_input_ids) + req.sampling_params.max_new_tokens - 1


def slots_needed(reqs: Sequence[Req], page_size: int) -> int:
    """KV slots a batch needs at its longest, counted in whole pages per request."""
    return sum(pages_for(max_positions(req), page_size) for req in reqs) * page_size


AllocSlots = Callable[[Sequence[int], Sequence[int], Sequence[int]], torch.Tensor]


def prepare_forward(runner: ModelRunner, reqs: Sequence[Req], alloc_slots: AllocSlots | None = None) -> ForwardBatch:
    """The ForwardBatch for ``reqs``, each sending fill_ids[cached_len:device_len], with
    slots allocated for those positions and recorded in the request's table row.

    ``alloc_slots(prefix_lens, seq_lens, last_locs)`` defaults to the allocator's
    ``alloc_extend``; stage 5's ScheduleBatch passes one that first evicts from its prefix cache.
    """
    table = runner.req_to_token_pool.req_to_token
    rows = [req.req_pool_idx for req in reqs]
    prefix_lens = [req.cached_len for req in reqs]
    seq_lens = [req.device_len for req in reqs]
    # The slot of each request's newest stored position (its last page gets filled first). Only
    # pages of several slots have room left to fill: with page_size 1 the read (a host sync on a
    # GPU) is skipped.
    if runner.page_size == 1:
        last_locs = [0] * len(rows)
    else:
        last_locs = table[rows, [max(n - 1, 0) for n in prefix_lens]].tolist()
    # BEGIN EXERCISE: allocate the new positions' slots, record them in the table, build the ForwardBatch
    # [#what-you-write]
    out_cache_loc = (alloc_slots or runner.allocator.alloc_extend)(prefix_lens, seq_lens, last_locs)
    start = 0
    for row, prefix_len, seq_len in zip(rows, prefix_lens, seq_lens):
        table[row, prefix_len:seq_len] = out_cache_loc[start : start + seq_len - prefix_len]
        start += seq_len - prefix_len
    return ForwardBatch.build(
        [req.fill_ids[req.cached_len : req.device_len] for req in reqs],
        prefix_lens,
        runner.attn_backend,
        device=runner.device,
        req_pool_indices=rows,
        out_cache_loc=out_cache_loc,
    )
    # END EXERCISE


class StaticBatchEngine:
    def __init__(
        self,
        model: CausalLM,
        pool_size: int,
        page_size: int = 1,
        max_running_requests: int = 64,
        max_context_len: int | None = None,
        attention_backend: str = "auto",
    ):
        self.runner = ModelRunner(model, pool_size, page_size, max_running_requests, max_context_len, attention_backend)
        self.running: list[Req] = []

    # --- admission ------------------------------------------------------------------------------

    def check_fits(self, reqs: Sequence[Req]) -> None:
        """Refuse, before any model work, a batch that the pool cannot hold to the end."""
        runner = self.runner
        need, free = slots_needed(reqs, runner.page_size), runner.allocator.available_size()
        if need > free:
            raise PoolExhaustedError(
                f"this static batch needs {need} KV slots at its longest ({len(reqs)} requests, "
                f"prompt + max_new_tokens - 1 positions each, in pages of {runner.page_size}) but the pool has "
                f"{free} free of {runner.allocator.size}. Give the pool at least {need} slots (pool_size), "
                "or send fewer requests / lower max_new_tokens."
            )
        rows_free = runner.req_to_token_pool.available_size()
        if len(reqs) > rows_free:
            raise PoolExhaustedError(
                f"this static batch has {len(reqs)} requests but only {rows_free} request rows are free; "
                "raise max_running_requests or send fewer requests"
            )
        longest = max(reqs, key=max_positions)
        if max_positions(longest) > runner.req_to_token_pool.max_context_len:
            raise ValueError(
                f"request {longest.rid} needs {max_positions(longest)} positions, more than max_context_len="
                f"{runner.req_to_token_pool.max_context_len}; shorten it or raise max_context_len"
            )

    def add_requests(self, reqs: Sequence[Req]) -> None:
        if self.running:
            raise RuntimeError("a static batch is still running; new requests wait until it is done")
        if not reqs:
            raise ValueError("a batch needs at least one request")
        self.check_fits(reqs)
        for req, row in zip(reqs, self.runner.req_to_token_pool.alloc(len(reqs))):
            req.req_pool_idx = row  # the request's row in req_to_token (SGLang's field name)
        self.running = list(reqs)

    # --- one step -------------------------------------------------------------------------------

    def prepare_forward(self, reqs: Sequence[Req]) -> ForwardBatch:
        return prepare_forward(self.runner, reqs)

    def release(self, req: Req) -> None:
        """Give a finished request's slots and table row back."""
        row = req.req_pool_idx
        # BEGIN EXERCISE: free a finished request's slots and its table row [#what-you-write]
        self.runner.allocator.free(self.runner.req_to_token_pool.req_to_token[row, : req.cached_len])
        self.runner.req_to_token_pool.free(row)
        req.req_pool_idx = None
        # END EXERCISE

    def step(self) -> list[Req]:
        """One forward pass for every running request; returns the requests it finished."""
        batch = self.prepare_forward(self.running)
        prompt_rows = with_prompt_rows(batch, self.running)  # (a prefill's prompt rows, for prompt_logprobs)
        logits = score_prompts(prompt_rows, self.runner.forward(batch))
        self.process_batch_result(logits)
        check_not_stuck(self.running)
        # Retire at once: a finished request's slots are free for the others from the next step on.
        finished = [req for req in self.running if req.finished]
        for req in finished:
            self.release(req)
        self.running = [req for req in self.running if not req.finished]
        return finished

    def process_batch_result(self, logits: torch.Tensor) -> None:
        """After the pass: row i of ``logits`` belongs to ``self.running[i]``."""
        # BEGIN EXERCISE: mark the pass cached, sample one token per request, append, check finished [#what-you-write]
        for req in self.running:
            req.cached_len = req.device_len
        append_sampled(self.running, logits)
        # END EXERCISE

    def run(self, reqs: Sequence[Req]) -> None:
        """Run a static batch to completion (each Req ends with its output_ids and finish reason).
        If a step raises (or is interrupted: Ctrl-C in a notebook), the batch is aborted and the
        error passed on, so the engine is empty again and takes the next batch."""
        self.add_requests(reqs)
        try:
            with torch.inference_mode():
                while self.running:
                    self.step()
        except BaseException:
            self.abort_batch()
            raise

    def abort_batch(self) -> None:
        """End every running request (finish reason "abort") and take back all the batch held:
        after a failed step nobody knows which slots its last pass allocated, but a static batch
        shares its pool with no one, so every allocated page is the batch's."""
        for req in self.running:
            if req.req_pool_idx is not None:
                self.runner.req_to_token_pool.free(req.req_pool_idx)
                req.req_pool_idx = None
            req.abort()
        self.running = []
        self.runner.allocator.free_orphans(torch.empty(0, dtype=torch.long))

    def generate(
        self,
        tokenizer: Tokenizer,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateOutput]:
        """Stage 2's ``generate`` contract, served as one static batch out of the pool."""
        reqs = make_reqs(tokenizer, prompts, sampling_params, self.runner.model.config.vocab_size)
        self.run(reqs)
        return [make_output(req) for req in reqs]

    # --- looking inside -------------------------------------------------------------------------

    def slot_map(self) -> torch.Tensor:
        """Who holds each pool slot: the row (req_pool_idx) of the request whose token is
        there, FREE, RESERVED (the dummy page) or PAGE_TAIL (in a request's page, not yet used)."""
        allocator, table = self.runner.allocator, self.runner.req_to_token_pool.req_to_token
        p = allocator.page_size
        allocated = allocator.page_allocated.repeat_interleave(p)
        owner = torch.where(allocated, PAGE_TAIL, FREE)
        owner[:p] = RESERVED
        for req in self.running:
            owner[table[req.req_pool_idx, : req.cached_len].cpu()] = req.req_pool_idx
        return owner


def generate_static_batch(
    model: CausalLM,
    prompts_ids: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    eos_token_ids: Sequence[int] = (),
    pool_size: int | None = None,
    page_size: int = 1,
    attention_backend: str = "auto",
) -> list[list[int]]:
    """Greedy continuations of several prompts run as one static batch out of one pool
    (per prompt: stage 3's ``cached_generate`` contract). ``max_new_tokens`` is one limit for
    all prompts or one per prompt; ``pool_size`` defaults to exactly what the batch needs."""
    limits = [max_new_tokens] * len(prompts_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts_ids):
        raise ValueError(f"{len(prompts_ids)} prompts but {len(limits)} max_new_tokens values")
    reqs = [
        Req(
            rid=i,
            origin_input_ids=ids,
            sampling_params=SamplingParams(temperature=0.0, max_new_tokens=n),
            eos_token_ids=eos_token_ids,
        )
        for i, (ids, n) in enumerate(zip(prompts_ids, limits))
    ]
    engine = StaticBatchEngine(
        model,
        pool_size=pool_size if pool_size is not None else slots_needed(reqs, page_size),
        page_size=page_size,
        max_running_requests=len(reqs),
        max_context_len=max(max_positions(req) for req in reqs),
        attention_backend=attention_backend,
    )
    engine.run(reqs)
    return [list(req.output_ids) for req in reqs]
