"""Load a checkpoint into ``TPCausalLM``, each rank reading only its slices.

safetensors files are memory-mapped, and ``safe_open(...).get_slice(name)`` reads rows or
columns of one tensor without touching the rest (SGLang's ``weight_loader`` methods do the same
on each parameter). Each parallel layer names the slices it is made of (layers.py ``Shard``):

    qkv_proj.weight    = rows of q_proj.weight (its query heads), k_proj, v_proj (its KV heads), stacked
    gate_up_proj.weight = rows of gate_proj.weight and up_proj.weight, stacked
    o_proj.weight, down_proj.weight = columns (the input this rank's heads / MLP slice produce)
    embed_tokens.weight, lm_head.weight = rows (its slice of the vocabulary; zero rows pad the last)
    norms, row-parallel biases = the whole tensor (every rank applies them to the full hidden state)

So a 2-rank group reads the checkpoint once between its ranks, plus the small replicated parts.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from s00_foundation.config import ModelConfig
from s00_foundation.device import avoid_cudnn_attention, default_dtype
from s00_foundation.loader import checkpoint_files, resolve_model_path

from .layers import Shard
from .model import TPCausalLM
from .parallel_state import TPGroup


def read_shard(handle, name: str, shard: Shard) -> torch.Tensor:
    """Rows (or columns) ``shard.start:shard.stop`` of checkpoint tensor ``name``; rows past the
    tensor's end are zeros for a padded shard (a vocabulary's last), a ValueError for any other."""
    piece = handle.get_slice(name)
    length = piece.get_shape()[shard.dim]
    if shard.stop > length and not shard.padded:
        # Zeros here would be a head or a slice of the MLP that no rank computes: wrong tokens, no error
        what = "rows" if shard.dim == 0 else "columns"
        raise ValueError(
            f"{name} has {length} {what}, but this rank's shard asks for {what} {shard.start}:{shard.stop}: "
            "the split hands out more than the checkpoint holds (see head_ranges)"
        )
    stop = min(shard.stop, length)
    part = piece[shard.start : stop] if shard.dim == 0 else piece[:, shard.start : stop]
    if stop - shard.start < shard.size:  # padding of the last vocabulary slice
        pad = list(part.shape)
        pad[shard.dim] = shard.size - max(0, stop - shard.start)
        part = torch.cat([part, part.new_zeros(pad)], dim=shard.dim)
    return part


def load_tp_model(
    model: str | Path, tp: TPGroup, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> TPCausalLM:
    """This rank's part of the model at ``model`` (a folder or hub id), on ``device`` (default:
    the group's) in ``dtype`` (default: the device's)."""
    folder = resolve_model_path(model)
    device = torch.device(device) if device is not None else tp.device
    dtype = dtype or default_dtype(device)
    avoid_cudnn_attention(device)
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        tp_model = TPCausalLM(config, tp)
    with ExitStack() as stack:
        handles = {}
        for path in checkpoint_files(folder):
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            handles.update({name: handle for name in handle.keys()})
        state = {}
        for full_name, _ in tp_model.named_parameters():
            module_name, _, param = full_name.rpartition(".")
            module = tp_model.get_submodule(module_name)
            parent = module_name.rpartition(".")[0]
            prefix = f"{parent}." if parent else ""
            if hasattr(module, "weight_shards"):
                pieces = [
                    read_shard(handles[f"{prefix}{s.name}.{param}"], f"{prefix}{s.name}.{param}", s)
                    for s in module.weight_shards(param)
                ]
                tensor = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
            else:  # norms: every rank holds the whole tensor
                tensor = handles[full_name].get_tensor(full_name)
            state[full_name] = tensor.to(device=device, dtype=dtype)
    missing, _ = tp_model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        tp_model.lm_head.weight = tp_model.model.embed_tokens.weight  # assign=True replaced the shared one
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        raise ValueError(f"{folder}: no checkpoint tensors for {missing[:5]}")
    return tp_model.eval()
