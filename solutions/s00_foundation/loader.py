"""Load a Hugging Face model folder (config.json + safetensors) into ``CausalLM``.

Accepts a local folder, or a hub id when a network is there (``Qwen/Qwen3-0.6B``). Weights
are read straight from safetensors onto the target device and dtype; the model is built on the
``meta`` device first so no time is spent initialising weights that are overwritten anyway.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .config import ModelConfig
from .device import avoid_cudnn_attention, default_device, default_dtype
from .model import CausalLM


def resolve_model_path(model: str | Path) -> Path:
    """A local folder as is; anything else is treated as a hub id and downloaded (needs a network)."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists() or str(model).startswith((".", "/")) or str(model).count("/") != 1:
        raise FileNotFoundError(
            f"{model} is not a model folder (expected a folder with config.json) nor a hub id like 'Qwen/Qwen3-0.6B'"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
        )
    except Exception as exc:  # offline, unknown id, gated repo...
        raise FileNotFoundError(f"could not fetch {model!r} from the Hugging Face hub: {exc}") from exc


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (those its index names, when it has one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    return [folder / name for name in names]


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        state.update(load_file(str(path)))
    return state


def load_model(
    model: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> CausalLM:
    folder = resolve_model_path(model)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    avoid_cudnn_attention(device)
    config = ModelConfig.from_folder(folder)
    state = load_state_dict(folder)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints still store a copy
    with torch.device("meta"):
        model_ = CausalLM(config)
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in state.items()}
    missing, unexpected = model_.load_state_dict(state, strict=False, assign=True)
    # Checkpoints may carry buffers we compute ourselves (e.g. rotary inv_freq): ignore only those.
    unexpected = [n for n in unexpected if not n.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(
            f"{folder}: weights do not match the {config.model_type} architecture; missing={missing[:5]} "
            f"unexpected={unexpected[:5]}"
        )
    return model_.eval()
