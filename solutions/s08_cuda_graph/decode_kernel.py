"""A fused decode attention for CPUs, in C++ (decode_kernel.cpp), built the first time it is needed.

table_attention.py reads K and V through the table with two library operations, and is still
1.1-1.4x above the memory floor: the scores pass reads every key once per query head, and every
row is padded to the batch's longest. One loop written for the job does better::

    for each (request, KV head), the threads sharing the work by total length:
        read each of the request's keys once, score the G query heads of that KV head with it
        softmax over the request's own length (no padding, no mask)
        read each value once, add it into the G outputs

The kernel is plain C++ with a portable vector type (see its comments); ``torch.utils.cpp_extension``
compiles it with the machine's C++ compiler the first time an engine asks (a few seconds; the
build is cached under ``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``, and reused while
the source is unchanged) and registers it as ``torch.ops.engine_cpu.decode_attention``. Threads
come from torch's own pool (``at::parallel_for``), so the engine's ``torch_threads`` counts for it
too.

Measured on this course's CPU (2 cores, 2 torch threads; the lesson has the whole table): one
decode step of SmolLM2-135M's shape, 64 requests of 512 keys, 239.3 ms against 273.4 through the
table and 134.2 for the bare pass (``tools/benchmark_decode.py --shape smollm2 --threads 2``, in a
busy hour of the shared host); 1.06-1.23x the memory floor where the table path is 1.11-1.41x. In
``make bench``'s workload b (128 requests of uneven lengths, where the table also pays for padding)
the kernel's first version took 12.6 s of decode attention against 17.6 s through the table, of
55.8 and 60.9 s in all; reading every key and value once would take 7.7 s.

The decode kernel reads a float32 or a bfloat16 pool (``POOL_DTYPES``): a bfloat16 key or value is
widened to float32 as it is loaded (exact), the arithmetic is float32 either way, and a bfloat16
pool is half the bytes a step streams. The query may be float32 or the pool's dtype, and the output
comes back in the query's (a bfloat16 model's rounded once, as ``.to(torch.bfloat16)`` rounds).

The same library holds the prefill's attention (extend_kernel.cpp, ``torch.ops.engine_cpu.
extend_attention``, float32 or bfloat16): a request's new tokens against its whole context, read in
place through the table, causal, flash-attention style (decode_attention.py's ``forward_extend``
calls it).

When there is no compiler (or ``ENGINE_DECODE_KERNEL=off`` or ``ENGINE_CPU_KERNELS=off`` is set),
``load()`` says why and the backend reads through the table instead, and extends take stage 4's
path: the same tokens, a little slower.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from s00_foundation.cpu_extension import build, switched_off

# decode_kernel.cpp and extend_kernel.cpp (the prefill's attention), one library, built by s00
# cpu_extension.py (which also says where the compiler is missing, and ENGINE_CPU_KERNELS=off).
SOURCES = [Path(__file__).with_name(name) for name in ("decode_kernel.cpp", "extend_kernel.cpp")]
NAME = "engine_cpu_decode_kernel"
# The pools the kernels read (a bfloat16 key is widened to float32 as it is loaded, the arithmetic
# is float32; the decode kernel's query and output are float32 or the pool's dtype, the extend
# kernel's the pool's).
POOL_DTYPES = (torch.float32, torch.bfloat16)
OFF = "ENGINE_DECODE_KERNEL"  # set to "off" to never build or use these two (ENGINE_CPU_KERNELS: any)


@dataclass(frozen=True)
class DecodeKernel:
    """The loaded kernel, or why there is none (``op`` None)."""

    op: Callable[..., torch.Tensor] | None  # torch.ops.engine_cpu.decode_attention
    how: str  # the flags it was built with, or the reason it is missing
    extend_op: Callable[..., torch.Tensor] | None = None  # torch.ops.engine_cpu.extend_attention, built with it


@functools.cache  # once per process: the library, once loaded, stays registered with torch
def load() -> DecodeKernel:
    """Build (or find in the cache) and load the kernels; never raises."""
    reason = switched_off(OFF)
    if reason is not None:
        return DecodeKernel(None, reason)
    built, how = build(NAME, SOURCES)
    if not built:
        return DecodeKernel(None, how)
    ops = torch.ops.engine_cpu
    return DecodeKernel(ops.decode_attention, how, ops.extend_attention)
