"""``StructuredOutputEngine`` (the package's ``Engine``): stage 10's engine, and a request may name
a grammar its output must follow::

    engine = Engine()
    params = StructuredSamplingParams(json_schema={"type": "object", ...}, max_new_tokens=128)
    [out] = engine.generate(["Describe a cat as JSON"], params)      # out.text parses, and validates
    StructuredSamplingParams(regex=r"(yes|no)")                       # SGLang's regex extension

Free requests (plain SamplingParams) run exactly as in stage 10, in the same batches. Both loops
work: overlapped (``disable_overlap=False``) and plain (``disable_overlap=True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from s05_continuous_batching.engine import EngineConfig
from s10_overlap_scheduling.engine import OverlapEngine, OverlapEngineConfig

from .grammar_backend import COMPILE_THREADS, GrammarBackend
from .scheduler import GRAMMAR_TIMEOUT_S, GrammarScheduler


@dataclass
class StructuredOutputEngineConfig(OverlapEngineConfig):
    """Stage 10's fields, plus the grammar backend's: ``grammar_threads`` compile at once, and a
    grammar still compiling after ``grammar_timeout`` seconds aborts its request."""

    grammar_threads: int = COMPILE_THREADS
    grammar_timeout: float = GRAMMAR_TIMEOUT_S


class StructuredOutputEngine(OverlapEngine):
    config_class: ClassVar[type[EngineConfig]] = StructuredOutputEngineConfig
    scheduler_class = GrammarScheduler
    config: StructuredOutputEngineConfig
    scheduler: GrammarScheduler

    def scheduler_options(self) -> dict[str, Any]:
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer (the grammar is written in text)")
        c = self.config
        eos = self.tokenizer.eos_token_ids
        backend = GrammarBackend(self.tokenizer.hf, self.model.config.vocab_size, eos, threads=c.grammar_threads)
        return super().scheduler_options() | dict(grammar_backend=backend, grammar_timeout=c.grammar_timeout)

    def describe(self) -> str:
        return super().describe() + "\ngrammars: llguidance (JSON schema, regex), compiled in the background"


Engine = StructuredOutputEngine  # the stage's public name
