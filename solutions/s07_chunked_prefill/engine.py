"""``ChunkedPrefillEngine`` (the package's ``Engine``): stage 6's engine with chunked prefill,
same APIs, plus the config field ``chunked_prefill_size``::

    engine = Engine(chunked_prefill_size=256)       # None: no chunking (stage 6)
    outputs = engine.generate(prompts, params)      # tokens identical whatever the budget
    engine = Engine()                               # "auto": 512 a step for add_request/step
                                                    # (a server), 2048 inside generate()

A smaller budget keeps the running requests' inter-token latency low while a long prompt is
being read, at the price of that prompt's time to first token (more, smaller passes). Only a
stream pays that price: ``generate`` returns a whole workload at once, so by default its steps
take a larger budget (see OFFLINE_CHUNKED_PREFILL_SIZE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Sequence

from s02_request_and_sampling.engine import PromptInput
from s02_request_and_sampling.sampling_params import SamplingParams
from s05_continuous_batching.engine import EngineConfig, RequestOutput
from s05_continuous_batching.prefix_cache import PrefixCache
from s06_radix_cache.engine import RadixEngine, RadixEngineConfig

from .prefix_cache import ChunkCache, ChunkedRadixCache
from .scheduler import ChunkedPrefillScheduler

# The step budget that chunked_prefill_size="auto" (the default) gives. Requests added one by one
# (add_request, step: what a server does) may be streamed: every step delays each running request's
# next token, so steps stay small (GPU servers use 2048-8192 tokens, where a bigger pass costs little
# more). generate() returns a whole workload at once: nobody reads its tokens as they come, only its
# total time counts, and fewer, larger passes finish it sooner (every request admitted sooner, the
# batch decoding full for longer). Measured on a 2-core CPU with SmolLM2-135M (tools/benchmark_offline.py
# workloads, alternating): 2048 against 512 made b 6-7% and d 12% faster; 4096 was slower than 2048
# on d. vLLM splits the same way (on a CPU its offline LLM class takes 4096 tokens a step, its server 2048).
SERVING_CHUNKED_PREFILL_SIZE = 512
OFFLINE_CHUNKED_PREFILL_SIZE = 2048


@dataclass
class ChunkedPrefillEngineConfig(RadixEngineConfig):
    """Stage 6's fields, plus ``chunked_prefill_size``: prompt tokens per step (see
    ChunkedPrefillScheduler); None turns chunking off; "auto" (the default):
    SERVING_CHUNKED_PREFILL_SIZE for the step API, OFFLINE_CHUNKED_PREFILL_SIZE inside
    ``generate``. A number or None applies to both."""

    chunked_prefill_size: int | None | Literal["auto"] = "auto"


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
            chunked_prefill_size=self.chunked_prefill_size(offline=False),
            schedule_policy=c.schedule_policy,
            **self.scheduler_options(),
        )

    def chunked_prefill_size(self, offline: bool) -> int | None:
        """The step budget the config asks for: its number or None, or for "auto" the offline
        (``generate``) or serving (the step API) default."""
        size = self.config.chunked_prefill_size
        if size == "auto":
            return OFFLINE_CHUNKED_PREFILL_SIZE if offline else SERVING_CHUNKED_PREFILL_SIZE
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                'chunked_prefill_size must be a positive number of tokens, None (no chunking) or "auto" '
                f"({SERVING_CHUNKED_PREFILL_SIZE} a step for requests added one by one, "
                f"{OFFLINE_CHUNKED_PREFILL_SIZE} inside generate()), got {size!r}"
            )
        return size

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Stage 5's offline API, its steps under the offline budget (``chunked_prefill_size(offline=True)``);
        the step API's budget is back when it returns. The tokens are the same whatever the budget."""
        scheduler = self.scheduler
        scheduler.chunked_prefill_size = self.chunked_prefill_size(offline=True)
        try:
            return super().generate(prompts, sampling_params)
        finally:
            scheduler.chunked_prefill_size = self.chunked_prefill_size(offline=False)


Engine = ChunkedPrefillEngine  # the stage's public name
