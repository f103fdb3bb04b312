"""Which device, dtype and CPU threads an engine runs with when the caller does not say, and
how small per-step tensors reach the device.

CPU runs in float32 (that is also how every stage is checked against ``transformers``);
CUDA runs in bfloat16, the dtype these models are trained and served in.

Threads: torch runs CPU work on a pool of OpenMP threads. One per physical core is the useful
most (two hyper-threads of one core share its vector units), and more threads than free cores
is far worse than fewer: on a busy 2-core machine a forward pass with 2 threads was measured
10-30x slower than with 1, as each thread waits for the other at every operator's barrier.
So the engine sets the count deliberately (``set_torch_threads``) and says it (``describe``).

Attention kernels: on CUDA, PyTorch's SDPA may pick cuDNN's kernel, which builds a plan for every
new shape; the engine's attention changes shape nearly every call, so a model placed on a GPU
takes cuDNN out of SDPA's choices (``avoid_cudnn_attention``).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Sequence

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads of one core count once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
            )
        except OSError:  # no sysfs (macOS, some containers): count logical CPUs instead
            cores.add(("", str(cpu)))
    return max(1, len(cores))


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's vendor id as the CPU reports it ("GenuineIntel", "AuthenticAMD", ...), or "" where
    it cannot be read (macOS, a CPU that is not x86). Libraries choose kernels by it (s00 linear.py)."""
    try:
        with cpuinfo.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # no /proc (macOS, Windows)
        pass
    processor = platform.processor()  # Windows names the vendor here: "AMD64 Family 25 ..., AuthenticAMD"
    return next((word for word in processor.replace(",", " ").split() if word.endswith(("Intel", "AMD"))), "")


def default_torch_threads() -> int:
    """OMP_NUM_THREADS when the environment sets it (the test suite sets 1), else one per physical core."""
    from_env = os.environ.get("OMP_NUM_THREADS", "")
    return int(from_env) if from_env.isdigit() and int(from_env) > 0 else physical_cores()


def set_torch_threads(threads: int | None = None) -> int:
    """Set torch's CPU thread count (None: ``default_torch_threads()``); returns it.

    A process-wide setting: every engine and model in the process shares torch's thread pool.
    """
    threads = default_torch_threads() if threads is None else threads
    if threads < 1:
        raise ValueError(f"torch_threads must be >= 1 (or None for one per physical core), got {threads}")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def avoid_cudnn_attention(device: torch.device | str) -> None:
    """On CUDA, take cuDNN's kernel out of the ones PyTorch's SDPA may pick (a process-wide
    switch, like the thread count; the flash, memory-efficient and math kernels stay).

    cuDNN's attention builds an execution plan for every new shape, and the engine's attention
    has a new shape at nearly every call: a request's keys grow by one each decode step, and
    every prefill chunk has its own length. Measured on an H200 (bfloat16, torch 2.11, cuDNN
    9.19; float32 never picks cuDNN): a one-token decode at a new length took 38-59 ms with cuDNN
    against 0.16 ms without, a 16-token extend 53-101 ms against 2.5 ms. Captured in CUDA graphs,
    its decode also did not replay reproducibly: the same graph on the same inputs gave logits up
    to 0.1 apart, where the other kernels replayed identically. The price: with grouped-query heads
    torch's flash and memory-efficient kernels refuse dense inputs, so attention runs the math
    kernel, 0.23-0.31 ms a call on a decode bucket against a cached cuDNN plan's 0.08 ms.
    """
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def describe(device: torch.device | str) -> str:
    """A short human name for a device, for milestone and benchmark output."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} torch thread{'s' if threads != 1 else ''}, {physical_cores()} physical cores)"


def host_to_device(
    values: Sequence[float] | Sequence[bool] | torch.Tensor, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """A ``dtype`` tensor of ``values`` (numbers, or a tensor on the CPU) on ``device``, without
    making the host wait for the GPU. ``dtype`` has no default: guessed, 1.5 could become 1, or
    an empty list of slot ids a float tensor.

    ``torch.tensor(values, device="cuda")`` copies from ordinary (pageable) host memory, which
    CUDA can only do synchronously: the host stops until every kernel already queued has run.
    Copied from page-locked ("pinned") memory with ``non_blocking=True``, the copy is queued like
    a kernel and the host goes on preparing the next step. (torch keeps the pinned buffer alive
    until the copy has run.) On a CPU it is simply the tensor.
    """
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
