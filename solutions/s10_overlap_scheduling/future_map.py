"""``FutureMap``: the tokens of a step whose forward has not finished, as placeholders.

With overlap, step N+1 is built while step N still runs, so the token each decoding request
feeds next is not known yet. It gets a *future id* instead: a negative number naming a slot of a
device-side buffer (SGLang's ``FutureMap``)::

    step N launched     its sampled tokens will be written to buffer[5], buffer[6], buffer[7]
    step N+1 built      its input ids:   [ 812  -5  -6  -7 | 31 44 90 ]   (a prefill needs no future)
    step N+1 forward    first thing it does: resolve -> [ 812  t5  t6  t7 | 31 44 90 ]
                        (step N has finished by then: both run, in order, on one worker)

The CPU never waits for step N's tokens to build step N+1; it reads them later, to append them
to the requests and check their stop conditions. The buffer is a ring: an id is reused only after
``capacity`` more tokens were allocated, long after the batch that read it was done.
"""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, capacity: int, device: torch.device | str):
        """``capacity``: future ids alive at once at most (the engine gives 4 per table row: a step
        in flight and the one being built hold at most one each per request)."""
        if capacity < 1:
            raise ValueError(f"a future map needs a capacity of at least 1 token, got {capacity}")
        self.capacity = capacity
        # Index 0 is never handed out: -0 is not negative, so it could not mark a future.
        self.token_ids = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        self.next_index = 1

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh future ids (negative), one per token a step will sample."""
        if n > self.capacity:
            raise ValueError(f"a step samples {n} tokens, more than the future map's capacity of {self.capacity}")
        indices = [(self.next_index - 1 + i) % self.capacity + 1 for i in range(n)]
        if indices:
            self.next_index = indices[-1] % self.capacity + 1
        return [-i for i in indices]

    def store(self, future_ids: list[int], token_ids: torch.Tensor) -> None:
        """After sampling (on the worker): write each sampled token where its future id points."""
        if future_ids:
            index = torch.tensor([-f for f in future_ids], dtype=torch.int64).to(
                self.token_ids.device, non_blocking=True
            )
            self.token_ids[index] = token_ids.to(self.token_ids.device)

    def resolve(self, input_ids: torch.Tensor) -> None:
        """Before the forward (on the worker): replace, in place, every negative id of
        ``input_ids`` by the token stored for it; other ids stay as they are."""
        # BEGIN EXERCISE: replace each negative id by its stored token, in place [#what-you-write]
        future = input_ids < 0
        looked_up = self.token_ids[(-input_ids).clamp(min=0)]
        input_ids.copy_(torch.where(future, looked_up, input_ids))
        # END EXERCISE
