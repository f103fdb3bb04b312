"""Stage 5's ``Engine`` with the radix cache: same APIs, plus ``enable_radix_cache`` and
``schedule_policy``::

    engine = Engine(enable_radix_cache=True, schedule_policy="lpm")
    outputs = engine.generate(prompts, params)
    engine.scheduler.stats.prefill_tokens, engine.scheduler.stats.cached_tokens
    print(engine.tree_cache.pretty(engine.tokenizer))

The tree outlives ``generate`` calls: a later call finds what earlier ones left.
"""

from __future__ import annotations

from s05_continuous_batching.engine import Engine as ContinuousEngine
from s05_continuous_batching.prefix_cache import NoPrefixCache

from .radix_cache import RadixCache
from .scheduler import RadixScheduler


class Engine(ContinuousEngine):
    def __init__(self, model=None, tokenizer=None, *, enable_radix_cache: bool = True, schedule_policy: str = "lpm", **knobs):
        """``model``, ``tokenizer`` and ``knobs``: see stage 5's Engine. ``enable_radix_cache=False``
        plugs in stage 5's NoPrefixCache (every prompt computed in full), for comparison."""
        self.enable_radix_cache, self.schedule_policy = enable_radix_cache, schedule_policy
        super().__init__(model, tokenizer, **knobs)

    # The caches it plugs in (stage 7 swaps in versions that also take half-prefilled requests).
    radix_cache_class = RadixCache
    no_prefix_cache_class = NoPrefixCache

    def make_prefix_cache(self):
        """The radix tree (kept as ``self.tree_cache``), or stage 5's NoPrefixCache when disabled."""
        allocator = self.runner.allocator
        self.tree_cache = self.radix_cache_class(allocator) if self.enable_radix_cache else None
        return self.tree_cache or self.no_prefix_cache_class(allocator)

    def make_scheduler(self, **knobs) -> RadixScheduler:
        return RadixScheduler(self.runner, self.make_prefix_cache(), schedule_policy=self.schedule_policy, **knobs)
