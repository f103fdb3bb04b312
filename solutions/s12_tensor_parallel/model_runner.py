"""``TPModelRunner``: stage 8's runner on one rank's shard of the model and of the KV cache.

Rank 0's runner broadcasts each batch to the other ranks just before running it, so every rank
runs the same batch at the same time; the other ranks' runners run what they receive
(tp_worker.py). This module imports no tokenizer and no scheduler: a follower rank needs neither.
"""

from __future__ import annotations

from typing import Any

import torch

from s00_foundation import cpu_ops
from s00_foundation.forward_batch import ForwardBatch
from s08_cuda_graph.model_runner import GraphModelRunner

from .model import TPCausalLM
from .parallel_state import TPGroup
from .tp_worker import BatchMessage


class TPModelRunner(GraphModelRunner):
    """Stage 8's runner on one rank's shard; rank 0's broadcasts each batch before running it."""

    def __init__(self, *args, tp: TPGroup, **kwargs):
        self.tp = tp
        super().__init__(*args, **kwargs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if not (self.tp.is_first and self.tp.size > 1):
            return super().forward(batch)
        self.tp.broadcast_object(BatchMessage.of(batch, self.req_to_token_pool.req_to_token))
        try:
            return super().forward(batch)
        except Exception as error:
            # The other ranks run this batch too. Stopped partway, rank 0 leaves them inside a
            # collective it will never join, and its next forward's collectives would pair with
            # theirs (wrong sums, or a hang): the group cannot go on, and says so from now on.
            if self.tp.failed is None:
                self.tp.failed = f"rank 0's forward failed midway: {type(error).__name__}: {error}"
            raise


def make_tp_runner(model: TPCausalLM, c: Any, pool_size: int, max_context_len: int, tp: TPGroup) -> TPModelRunner:
    """The runner every rank builds, from rank 0's engine config ``c`` and pool size (so every
    pool matches). Decodes run eagerly: capturing collectives in CUDA graphs is left out."""
    if model.device.type == "cpu":
        # Build or load the fused CPU loops now, before the ranks' ready barrier (the decode kernel
        # loads with the runner's backend). Loaded in the first forward, as one process does, a rank
        # waiting for the kernel cache's lock would keep the others waiting inside a collective,
        # against the group's timeout.
        cpu_ops.load()
    return TPModelRunner(
        model,
        pool_size,
        c.page_size,
        c.max_running_requests,
        max_context_len,
        c.attention_backend,
        disable_cuda_graph=True,
        tp=tp,
    )
