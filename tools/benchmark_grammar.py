"""Stage 11's library choice, measured: compile time and mask time per token of the grammar
libraries that are importable here (llguidance, the course's; outlines-core if installed, e.g.
``pip install --target /tmp/oc outlines-core==0.2.14`` and ``--extra-path /tmp/oc``), on the default
model's vocabulary, for the schemas of stage 11's milestone.

    .venv/bin/python tools/benchmark_grammar.py [--extra-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "solutions"))


def walk(step, steps: int) -> float:
    """Median seconds of the timed part of ``step`` over up to ``steps`` steps; ``step()`` returns
    (seconds it timed, whether the grammar goes on)."""
    times = []
    for _ in range(steps):
        seconds, more = step()
        times.append(seconds)
        if not more:
            break
    return statistics.median(times)


def bench_llguidance(hf, vocab: int, schemas: dict) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import torch

    start = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    print(
        f"llguidance {llguidance.__version__ if hasattr(llguidance, '__version__') else ''}: tokenizer bridge "
        f"{time.perf_counter() - start:.2f} s"
    )
    for name, schema in schemas.items():
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        compiled = time.perf_counter() - start
        bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)

        def step(matcher=matcher, bitmask=bitmask) -> tuple[float, bool]:
            start = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
            seconds = time.perf_counter() - start
            bits = ((torch.from_numpy(bitmask)[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
            allowed = bits.nonzero().flatten()  # any allowed token will do: the middle one
            start = time.perf_counter()
            more = not matcher.is_stopped() and matcher.consume_token(int(allowed[len(allowed) // 2]))
            return seconds + time.perf_counter() - start, more

        print(f"  {name:>8s}: compile {compiled * 1e3:7.1f} ms   mask+advance {walk(step, 30) * 1e6:7.0f} us")


def bench_outlines_core(hf, schemas: dict) -> None:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    words: dict[str, list[int]] = {}
    for token, i in hf.get_vocab().items():
        if i != hf.eos_token_id:
            words.setdefault(hf.convert_tokens_to_string([token]), []).append(i)
    vocabulary = Vocabulary(hf.eos_token_id, words)
    print(f"outlines-core: vocabulary {time.perf_counter() - start:.2f} s")
    for name, schema in schemas.items():
        start = time.perf_counter()
        guide = Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))
        compiled = time.perf_counter() - start

        def step(guide=guide) -> tuple[float, bool]:
            start = time.perf_counter()
            tokens = guide.get_tokens()
            guide.advance(tokens[len(tokens) // 2])
            return time.perf_counter() - start, not guide.is_finished()

        print(f"  {name:>8s}: compile {compiled * 1e3:7.1f} ms   allowed list+advance {walk(step, 30) * 1e6:7.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra-path", action="append", default=[], help="a folder with more libraries")
    args = parser.parse_args()
    sys.path[:0] = args.extra_path
    from transformers import AutoTokenizer

    from s00_foundation.paths import default_model_path
    from s11_structured_output.validity import CASES

    path = default_model_path()
    hf = AutoTokenizer.from_pretrained(str(path))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]  # the logits' width
    print(f"model: {path.name}   vocabulary: {vocab}   load average: {os.getloadavg()[0]:.2f}")
    schemas = {name: schema for name, (_, schema) in CASES.items()}
    bench_llguidance(hf, vocab, schemas)
    try:
        bench_outlines_core(hf, schemas)
    except ImportError:
        print("outlines-core: not installed (see the module docstring)")


if __name__ == "__main__":
    main()
