"""``ChunkedPrefillEngine`` (the package's ``Engine``): stage 6's engine with chunked prefill,
same APIs, plus the config field ``chunked_prefill_size``::

    engine = Engine(chunked_prefill_size=256)       # None: no chunking (stage 6)
    outputs = engine.generate(prompts, params)      # tokens identical whatever the budget

A smaller budget keeps the running requests' inter-token latency low while a long prompt is
being read, at the price of that prompt's time to first token (more, smaller passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from s05_continuous_batching.engine import EngineConfig
from s05_continuous_batching.prefix_cache import PrefixCache
from s06_radix_cache.engine import RadixEngine, RadixEngineConfig

from .prefix_cache import ChunkCache, ChunkedRadixCache
from .scheduler import ChunkedPrefillScheduler

DEFAULT_CHUNKED_PREFILL_SIZE = 512  # tokens; GPU servers use 2048-8192 (a bigger pass costs little more there)


@dataclass
class ChunkedPrefillEngineConfig(RadixEngineConfig):
    """Stage 6's fields, plus ``chunked_prefill_size``: prompt tokens per step (see
    ChunkedPrefillScheduler); None turns chunking off."""

    chunked_prefill_size: int | None = DEFAULT_CHUNKED_PREFILL_SIZE


class ChunkedPrefillEngine(RadixEngine):
    config_class: ClassVar[type[EngineConfig]] = ChunkedPrefillEngineConfig
    config: ChunkedPrefillEngineConfig
    scheduler: ChunkedPrefillScheduler

    def make_prefix_cache(self) -> PrefixCache:
        """Stage 6's choice, with caches that also take a half-prefilled request's chunks."""
        allocator = self.runner.allocator
        self.tree_cache = ChunkedRadixCache(allocator) if self.config.enable_radix_cache else None
        return self.tree_cache or ChunkCache(allocator)

    def make_scheduler(self) -> ChunkedPrefillScheduler:
        c = self.config
        return ChunkedPrefillScheduler(
            self.runner,
            self.make_prefix_cache(),
            chunked_prefill_size=c.chunked_prefill_size,
            schedule_policy=c.schedule_policy,
            **self.scheduler_options(),
        )


Engine = ChunkedPrefillEngine  # the stage's public name
