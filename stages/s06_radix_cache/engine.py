"""``RadixEngine`` (the package's ``Engine``): stage 5's engine with the radix cache, same APIs,
plus two config fields, ``enable_radix_cache`` and ``schedule_policy``::

    engine = Engine(enable_radix_cache=True, schedule_policy="lpm")
    outputs = engine.generate(prompts, params)
    engine.scheduler.stats.prefill_tokens, engine.scheduler.stats.cached_tokens
    print(engine.tree_cache.pretty(engine.tokenizer))

The tree outlives ``generate`` calls: a later call finds what earlier ones left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from s05_continuous_batching.engine import ContinuousBatchingEngine, EngineConfig
from s05_continuous_batching.prefix_cache import NoPrefixCache, PrefixCache

from .radix_cache import RadixCache
from .scheduler import RadixScheduler


@dataclass
class RadixEngineConfig(EngineConfig):
    """Stage 5's fields, plus: ``enable_radix_cache=False`` plugs in stage 5's NoPrefixCache
    (every prompt computed in full), for comparison; ``schedule_policy``: "lpm" or "fcfs"."""

    enable_radix_cache: bool = True
    schedule_policy: str = "lpm"


class RadixEngine(ContinuousBatchingEngine):
    config_class: ClassVar[type[EngineConfig]] = RadixEngineConfig
    config: RadixEngineConfig
    scheduler: RadixScheduler
    tree_cache: RadixCache | None  # the radix tree, None when it is disabled

    def make_prefix_cache(self) -> PrefixCache:
        """The radix tree (kept as ``self.tree_cache``), or stage 5's NoPrefixCache when disabled."""
        allocator = self.runner.allocator
        self.tree_cache = RadixCache(allocator) if self.config.enable_radix_cache else None
        return self.tree_cache or NoPrefixCache(allocator)

    def make_scheduler(self) -> RadixScheduler:
        return RadixScheduler(
            self.runner,
            self.make_prefix_cache(),
            schedule_policy=self.config.schedule_policy,
            **self.scheduler_options(),
        )


Engine = RadixEngine  # the stage's public name
