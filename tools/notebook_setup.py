"""The first call of every notebook: the implementation switch, and one line saying what runs where.

    import sys; sys.path.insert(0, "../tools")
    import notebook_setup; device = notebook_setup.start()

prints, as the notebook's first output, e.g.

    engine: the reference (solutions/)  |  device: cpu (1 thread)  |  torch 2.13.0

Which engine comes from the ENGINE_* settings (tools/impl_switch.py): `make lab` and
`make notebooks` run the reference; `make lab ENGINE_IMPL=stages` shows your own code.
"""

from __future__ import annotations

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
    print(f"engine: {engine_line(switch)}  |  device: {describe(chosen)}  |  torch {torch.__version__}", flush=True)
    return chosen
