"""Shared test setup: the implementation switch, tiny models, the default model, HF references.

The switch is installed before anything imports an engine package, so every test runs the
tree selected by ENGINE_IMPL (see tools/impl_switch.py). Tests under tests/stageNN/ are the
graded tests of stage N and get the ``stage(N)`` marker from their folder.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))

import impl_switch  # noqa: E402

SWITCH = impl_switch.install()

from tiny_models import FAMILIES, build_tiny_model  # noqa: E402

STAGE_DIR = re.compile(r"stage(\d\d)$")


def pytest_report_header(config):
    return SWITCH.describe()


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        match = STAGE_DIR.match(folder)
        if match:
            item.add_marker(pytest.mark.stage(int(match.group(1))))
        if folder == "gpu":
            item.add_marker(pytest.mark.gpu)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A stage exercise not written yet fails with one plain line instead of a traceback."""
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(NotImplementedError):
        message = str(call.excinfo.value)
        if message.startswith("Stage "):
            report.longrepr = f"not written yet -> {message}"
    return report


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_models")
    for family in FAMILIES:
        build_tiny_model(family, root / family)
    return root


@pytest.fixture(params=FAMILIES)
def tiny_model_dir(request, tiny_models_root) -> Path:
    """A tiny random model folder of each family in turn (llama, llama3, qwen2, qwen3)."""
    return tiny_models_root / request.param


@pytest.fixture(scope="session")
def cuda_device():
    """The GPU. Without one: a skip with the reason, or a failure under ENGINE_REQUIRE_GPU=1
    (`make test-gpu`), so a GPU run can never pass by skipping everything."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    reason = f"needs a CUDA GPU; torch {torch.__version__} sees none on this machine"
    if os.environ.get("ENGINE_REQUIRE_GPU") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct). Skipped when it is not set up, unless
    ENGINE_REQUIRE_DEFAULT_MODEL=1 (as in `make test`), where its absence is a failure."""
    from s00_foundation.paths import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:
        if os.environ.get("ENGINE_REQUIRE_DEFAULT_MODEL") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
