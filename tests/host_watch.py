"""Watching torch calls on a CPU for what a GPU would pay for (shared by the stage-8 tests and
the course's test of the watch itself).

On CUDA, a host read of a device value (``.item()``, ``.tolist()``, ``if tensor:``) waits for
every kernel queued before it, and a tensor built from Python data is a host-to-device copy. On
a CPU both are free, so nothing shows them; these modes see every such call through torch's
function and dispatch hooks and name it (with the engine's line that made it).

- ``HostWatch`` notes host reads and tensors built from Python data, each with its call site;
- ``DispatchWatch`` notes operators whose output shape depends on the data (which no CUDA graph
  can record);
- ``WatchedModel`` stands in for a model and runs it under both.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
FROM_PYTHON_DATA = {"tensor", "as_tensor", "from_numpy"}
DATA_DEPENDENT_SHAPES = {
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "_local_scalar_dense",
    "lift_fresh",
    "lift_fresh_copy",
}


def call_site() -> str:
    """'s05_continuous_batching/scheduler.py in process_batch_result': the innermost frame of the
    engine's own code (solutions/ or stages/) that made the call."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        for root in ("/solutions/", "/stages/"):
            if root in frame.filename:
                return f"{frame.filename.split(root)[1]} in {frame.name}"
    return "outside the engine"


class HostWatch(TorchFunctionMode):
    """Notes (what, where) for every host read and every tensor built from Python data."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []  # ("Tensor.tolist()", call site)
        self.from_python: list[tuple[str, str]] = []  # ("torch.tensor(...)", call site)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            self.reads.append((f"Tensor.{name}()", call_site()))
        elif name in FROM_PYTHON_DATA:
            self.from_python.append((f"torch.{name}(...)", call_site()))
        return func(*args, **(kwargs or {}))

    def problems(self) -> list[str]:
        """Each finding as a sentence, once."""
        return sorted(
            {f"{what} reads a device value on the host ({where})" for what, where in self.reads}
            | {f"{what} builds a tensor from Python data ({where})" for what, where in self.from_python}
        )


class DispatchWatch(TorchDispatchMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in DATA_DEPENDENT_SHAPES:
            self.found.append(f"aten.{name}: a result whose shape or value is read from the data")
        elif name in ("index", "index_put_", "index_put") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 else ())
            if i is not None
        ):
            self.found.append(f"aten.{name} with a boolean mask: a result shape that depends on the data")
        return func(*args, **(kwargs or {}))


class WatchedModel:
    """Stands in for a runner's model: runs it, and notes everything a CUDA graph could not record."""

    def __init__(self, model):
        self.model, self.calls, self.shapes = model, 0, []
        self.host = HostWatch()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        with self.host, DispatchWatch(self.shapes):
            return self.model(*args, **kwargs)

    @property
    def found(self) -> list[str]:
        return self.host.problems() + sorted(set(self.shapes))
