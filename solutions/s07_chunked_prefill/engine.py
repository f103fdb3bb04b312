"""Stage 6's ``Engine`` with chunked prefill: same APIs, plus ``chunked_prefill_size``::

    engine = Engine(chunked_prefill_size=256)       # None: no chunking (stage 6)
    outputs = engine.generate(prompts, params)      # tokens identical whatever the budget

A smaller budget keeps the running requests' inter-token latency low while a long prompt is
being read, at the price of that prompt's time to first token (more, smaller passes).
"""

from __future__ import annotations

from s06_radix_cache.engine import Engine as RadixEngine

from .prefix_cache import ChunkCache, RadixCache
from .scheduler import ChunkedPrefillScheduler

DEFAULT_CHUNKED_PREFILL_SIZE = 512  # tokens; GPU servers use 2048-8192 (a bigger pass costs little more there)


class Engine(RadixEngine):
    radix_cache_class = RadixCache  # stage 6's caches, plus cache_unfinished_req
    no_prefix_cache_class = ChunkCache

    def __init__(self, model=None, tokenizer=None, *, chunked_prefill_size: int | None = DEFAULT_CHUNKED_PREFILL_SIZE, **knobs):
        """``model``, ``tokenizer`` and ``knobs``: see stages 5 and 6. ``chunked_prefill_size``:
        prompt tokens per step (see ChunkedPrefillScheduler); None turns chunking off."""
        self.chunked_prefill_size = chunked_prefill_size
        super().__init__(model, tokenizer, **knobs)

    def make_scheduler(self, **knobs) -> ChunkedPrefillScheduler:
        return ChunkedPrefillScheduler(
            self.runner, self.make_prefix_cache(), chunked_prefill_size=self.chunked_prefill_size,
            schedule_policy=self.schedule_policy, **knobs,
        )
