"""tools/setup_model.py: the converted default model is a normal Hugging Face folder (not graded)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

import setup_model


def fake_converted_folder(folder, **config):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**setup_model.SPECIAL, **config}))
    (folder / "tokenizer.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, folder / "model.safetensors")
    return folder


def test_the_conversion_names_the_model_class_in_config_json():
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    setup_model.finish_config(config)
    assert config.to_dict()["architectures"] == ["LlamaForCausalLM"]
    assert {k: config.to_dict()[k] for k in setup_model.SPECIAL} == setup_model.SPECIAL


def test_an_older_conversion_without_architectures_is_noticed_and_completed_in_place(tmp_path, capsys):
    folder = fake_converted_folder(tmp_path / "model", vocab_size=2)
    assert setup_model.problems(folder) == [setup_model.NO_ARCHITECTURES]
    assert setup_model.main(["--out", str(folder)]) == 0  # no conversion: only the key is added
    assert "added architectures" in capsys.readouterr().out
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 2
    assert setup_model.problems(folder) == []
