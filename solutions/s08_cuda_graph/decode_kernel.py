"""A fused decode attention for CPUs, in C++ (decode_kernel.cpp), built the first time it is needed.

table_attention.py reads K and V through the table with two library operations, and is still
1.2-1.5x above the memory floor: the scores pass reads every key once per query head, and every
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

When there is no compiler (or ``ENGINE_DECODE_KERNEL=off`` is set), ``load()`` says why and the
backend reads through the table instead: the same tokens, a little slower.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

# decode_kernel.cpp and extend_kernel.cpp (the prefill's attention), one library; cpu_kernel.h what they
# share (ninja rebuilds when it changes).
SOURCES = [Path(__file__).with_name(name) for name in ("decode_kernel.cpp", "extend_kernel.cpp")]
NAME = "engine_cpu_decode_kernel"
# First choice: tuned for this CPU's vector units and threaded by OpenMP like torch itself; second:
# flags any C++17 compiler takes (Apple's clang has no -fopenmp: the kernel then runs on one thread).
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3"])
OFF = "ENGINE_DECODE_KERNEL"  # set to "off" to never build or use it


@dataclass(frozen=True)
class DecodeKernel:
    """The loaded kernel, or why there is none (``op`` None)."""

    op: Callable[..., torch.Tensor] | None  # torch.ops.engine_cpu.decode_attention
    how: str  # the flags it was built with, or the reason it is missing
    extend_op: Callable[..., torch.Tensor] | None = None  # torch.ops.engine_cpu.extend_attention, built with it


@functools.cache  # once per process: the library, once loaded, stays registered with torch
def load() -> DecodeKernel:
    """Build (or find in the cache) and load the kernel; never raises."""
    if os.environ.get(OFF, "").lower() in ("0", "off", "false", "no"):
        return DecodeKernel(None, f"off ({OFF}={os.environ[OFF]})")
    try:
        from torch.utils import cpp_extension
    except ImportError as error:  # a torch build without its C++ tooling
        return DecodeKernel(None, f"torch.utils.cpp_extension is missing ({error})")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return DecodeKernel(None, "no C++ compiler (install g++ or clang, or set CXX)")
    failures = []
    with ninja_on_path():
        for flags in FLAG_SETS:
            try:
                cpp_extension.load(
                    name=NAME,
                    sources=[str(source) for source in SOURCES],
                    extra_cflags=flags,
                    extra_ldflags=[f for f in flags if f == "-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
                ops = torch.ops.engine_cpu
                return DecodeKernel(ops.decode_attention, " ".join(flags), ops.extend_attention)
            except Exception as error:  # noqa: BLE001 - a build that fails for any reason falls back
                failures.append(f"{' '.join(flags)}: {str(error).strip().splitlines()[-1][:200]}")
    return DecodeKernel(None, "the build failed (" + "; ".join(failures) + ")")


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """``cpp_extension`` runs the ``ninja`` build tool by name: when it is not on PATH (a venv that
    is not activated), put the pip package's copy there for the build, and take it off again."""
    saved = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
        except ImportError:
            pass  # then cpp_extension says that ninja is missing, and load() passes that on
    try:
        yield
    finally:
        os.environ["PATH"] = saved
