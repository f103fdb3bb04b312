"""Shared by the stage-4 tests: a model wrapper that records every forward pass."""

from __future__ import annotations


class CountingModel:
    """Looks like the engine's model to the engine, and records each batch it runs."""

    def __init__(self, model):
        self.model = model
        self.config, self.device, self.dtype = model.config, model.device, model.dtype
        self.batches = []  # (mode, extend_lens, prefix_lens) per forward pass

    def __call__(self, batch, **kwargs):
        self.batches.append((batch.mode.value, list(batch.extend_lens), list(batch.prefix_lens)))
        return self.model(batch, **kwargs)
