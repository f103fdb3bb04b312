"""Shared by the stage-12 tests: tensor-parallel engines on the tiny models, and their tp=1 references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reference import engine_model, engine_tokenizer
from s02_request_and_sampling.sampling_params import SamplingParams
from s10_overlap_scheduling.engine import OverlapEngine

# Small pools and chunks: a 40-token prompt is prefilled in 3 chunks, and a shared system
# prompt is found in the radix cache (both must still work when every rank runs the batch).
# disable_overlap=False: the overlapped loop on any machine (by default a CPU overlaps only with a core to spare)
KNOBS: dict[str, Any] = dict(pool_size=1024, max_running_requests=16, chunked_prefill_size=16, disable_overlap=False)
SYSTEM = [33 + i % 90 for i in range(24)]  # a shared prefix, longer than a chunk
PROMPTS = [
    [72, 101, 108, 108, 111],
    [40 + i % 60 for i in range(40)],
    SYSTEM + [65, 66],
    SYSTEM + [67, 68, 69],
    [7],
]


def greedy(n: int) -> SamplingParams:
    # ignore_eos: the tiny random models may emit their EOS id; every run goes to the limit
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_new_tokens=n, ignore_eos=True)


def reference_outputs(path: Path, params) -> list[list[int]]:
    """The same prompts on stage 10's engine on one device (tp=1; stage 11 adds nothing to free
    requests): the tokens TP must reproduce."""
    engine = OverlapEngine(engine_model(str(path)), engine_tokenizer(str(path)), **KNOBS)
    return [out.output_ids for out in engine.generate(PROMPTS, params)]


def pid_running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
