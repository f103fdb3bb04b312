"""The first call of every notebook: the implementation switch, and one line saying what runs where.

    import sys; sys.path.insert(0, "../tools")
    import notebook_setup; device = notebook_setup.start()

prints, as the notebook's first output, e.g.

    engine: the reference (solutions/)  |  device: cpu (1 torch thread, 2 physical cores)  |  torch 2.13.0+cpu
    |  load average 0.41

(one line). Which engine comes from the ENGINE_* settings (tools/impl_switch.py): `make lab` and
`make notebooks` run the reference; `make lab ENGINE_IMPL=stages` shows your own code. The load
average (the last minute's) says how busy the machine was: the notebook's timings are only as quiet
as it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import impl_switch


def shown(path: Path) -> str:
    """A tree's folder relative to the repository when it lies inside it."""
    return f"{path.relative_to(impl_switch.REPO)}/" if path.is_relative_to(impl_switch.REPO) else str(path)


def engine_line(switch: impl_switch.Switch) -> str:
    if switch.impl == "solutions":
        return f"the reference ({shown(switch.solutions_dir)})"
    k = switch.reference_upto
    borrowed = f"; stages 1-{k} from {shown(switch.solutions_dir)}" if k else ""
    return f"your code ({shown(switch.stages_dir)}{borrowed})"


def start(device: str | None = None):
    """Install the switch, print which engine and device the notebook runs on, return the device
    (the default one: CUDA when there is a GPU, else the CPU; or ``device``)."""
    # tqdm (imported by transformers) warns that ipywidgets is missing; its plain bars are fine
    warnings.filterwarnings("ignore", message="IProgress not found")
    switch = impl_switch.install()
    import torch

    from s00_foundation.device import default_device, describe

    chosen = torch.device(device) if device is not None else default_device()
    load = f"  |  load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""  # not on Windows
    line = f"engine: {engine_line(switch)}  |  device: {describe(chosen)}  |  torch {torch.__version__}{load}"
    print(line, flush=True)
    return chosen
