"""The start every stage's milestone (``python -m sNN_...``) shares: which model, on which device.

parser = argparse.ArgumentParser(...)
add_model_args(parser)                  # --model, --device
...
path, device, model, tokenizer = load_from_args(parser.parse_args())
path, device, model = model_from_args(args)   # a milestone that needs no tokenizer
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .device import default_device
from .loader import load_model
from .model import CausalLM
from .paths import default_model_path
from .tokenizer import Tokenizer


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")


def model_from_args(args: argparse.Namespace) -> tuple[str | Path, torch.device | str, CausalLM]:
    """The model path (the default model unless --model), the device, and the model loaded there
    (its default dtype for that device)."""
    path = args.model or default_model_path()
    device = args.device or default_device()
    return path, device, load_model(path, device=device)


def load_from_args(args: argparse.Namespace) -> tuple[str | Path, torch.device | str, CausalLM, Tokenizer]:
    """``model_from_args`` and the model's tokenizer."""
    path, device, model = model_from_args(args)
    return path, device, model, Tokenizer(path)
