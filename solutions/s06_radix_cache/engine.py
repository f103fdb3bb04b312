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
        super().__init__(model, tokenizer, **knobs)
        old = self.scheduler  # stage 5's, built by the parent: keep its knobs, swap the cache and policy
        allocator = self.runner.allocator
        self.tree_cache = RadixCache(allocator) if enable_radix_cache else None
        self.scheduler = RadixScheduler(
            self.runner, self.tree_cache or NoPrefixCache(allocator), schedule_policy=schedule_policy,
            max_prefill_tokens=old.max_prefill_tokens, new_token_ratio=old.new_token_ratio, on_step=old.on_step, clock=old.clock,
        )
