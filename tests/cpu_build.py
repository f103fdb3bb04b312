"""Shared by the tests of the C++ CPU kernels: skip where this machine cannot build them, fail
where it could and the build failed (a kernel that a compiler here cannot build is a defect)."""

from __future__ import annotations

import shutil

import pytest


def require_built(loaded: bool, how: str, what: str) -> None:
    """``loaded``/``how``: what the loader said; ``what``: the kernels, for the message."""
    if loaded:
        return
    if "no C++ compiler" in how or how.startswith("off (") or shutil.which("c++") is None:
        pytest.skip(f"{what} are not available here: {how}")
    pytest.fail(f"a C++ compiler is here but {what} did not build: {how}")
