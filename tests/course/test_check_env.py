"""make check-env tells a learner how this CPU runs the model's matrix products (not graded)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from s00_foundation.device import cpu_vendor
from s00_foundation.linear import linear_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import check_env  # noqa: E402


def test_check_env_names_the_cpu_vendor_and_how_the_products_run(capsys):
    assert check_env.check_products(torch)
    line = capsys.readouterr().out.strip()
    assert line.startswith("[--]") and "matrix products on this CPU" in line, line
    assert (cpu_vendor() or "vendor unknown") in line and linear_kind(torch.device("cpu")) in line, line


def test_check_env_skips_the_products_without_torch(capsys):
    assert check_env.check_products(None)
    assert capsys.readouterr().out == ""
