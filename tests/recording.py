"""A stand-in for the engine's model that records every forward pass it runs (shared by the
stage 4-7 tests that check what the engine batches together, not only what it outputs)."""

from __future__ import annotations


class PassRecorder:
    """Looks like the engine's model to the engine, and records each forward pass it runs."""

    def __init__(self, model):
        self.model = model
        self.config, self.device, self.dtype = model.config, model.device, model.dtype
        self.passes = []  # (extend_lens, prefix_lens) per forward pass, rows in batch order

    def __call__(self, batch, **kwargs):
        self.passes.append((list(batch.extend_lens), list(batch.prefix_lens)))
        return self.model(batch, **kwargs)
