"""Installs the implementation switch in child processes of a switched run.

tools/impl_switch.py's install() puts this folder on PYTHONPATH, and Python imports
`sitecustomize` at start-up, so every child (a `python -m sNN_...` subprocess, a
multiprocessing worker, a notebook kernel) imports stage packages from the same trees
as its parent, read from the ENGINE_* variables it inherited.
"""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_engine_impl_switch", Path(__file__).resolve().parent.parent / "impl_switch.py"
)
_switch = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_switch)
_switch.install()
