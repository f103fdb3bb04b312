"""Which device and dtype an engine runs on when the caller does not say.

CPU runs in float32 (that is also how every stage is checked against ``transformers``);
CUDA runs in bfloat16, the dtype these models are trained and served in.
"""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def describe(device: torch.device | str) -> str:
    """A short human name for a device, for milestone and benchmark output."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads != 1 else ''})"
