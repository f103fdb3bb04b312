"""Stage 12's guards around the exercises (not graded: the loader, rank_config and the follower's
check are given). Each turns a split gone wrong into an error where it would otherwise run and
give wrong tokens: a shard past a checkpoint tensor's end (a KV head that does not exist) loaded
as zeros, an MLP that does not divide losing its last columns, a follower's batch that differs
from rank 0's (gloo gathers tensors of any size)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from s00_foundation.config import ModelConfig
from s00_foundation.forward_batch import ForwardBatch
from s12_tensor_parallel.layers import Shard, vocab_shard
from s12_tensor_parallel.model import rank_config
from s12_tensor_parallel.parallel_state import TPGroup
from s12_tensor_parallel.tp_worker import BatchMessage, check_rebuilt
from s12_tensor_parallel.weight_loader import read_shard


def test_only_a_vocabulary_shard_reads_past_the_end(tiny_models_root):
    path = tiny_models_root / "llama_gqa_bias"  # one KV head: k_proj has head_dim rows
    name = "model.layers.0.self_attn.k_proj.weight"
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        rows = handle.get_slice(name).get_shape()[0]
        assert read_shard(handle, name, Shard("k_proj", 0, 0, rows)).shape[0] == rows
        with pytest.raises(ValueError, match=f"has {rows} rows.*{rows}:{2 * rows}.*head_ranges"):
            read_shard(handle, name, Shard("k_proj", 0, rows, 2 * rows))  # a second KV head, which it lacks
        vocab = handle.get_slice("model.embed_tokens.weight").get_shape()[0]
        last = vocab_shard("embed_tokens", vocab, TPGroup(2, 3, torch.device("cpu")))
        padded = read_shard(handle, "model.embed_tokens.weight", last)
        assert padded.shape[0] == last.size and not padded[vocab - last.start :].any(), "padding rows are zeros"


def test_an_mlp_that_does_not_divide_is_refused(tiny_models_root):
    config = ModelConfig.from_folder(tiny_models_root / "llama")
    uneven = replace(config, num_attention_heads=6, num_key_value_heads=3, intermediate_size=128)
    with pytest.raises(ValueError, match="intermediate_size=128 does not divide by tp_size=3"):
        rank_config(uneven, TPGroup(0, 3, torch.device("cpu")))
    assert (
        rank_config(replace(uneven, intermediate_size=129), TPGroup(0, 3, torch.device("cpu"))).num_key_value_heads == 1
    )


def test_a_follower_batch_unlike_rank_0s_stops_naming_the_field():
    batch = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([0, 1, 2]),
        extend_lens=[3],
        seq_lens=[3],
        attn_backend=None,
        req_pool_indices=torch.tensor([0]),
        out_cache_loc=torch.tensor([1, 2, 3]),
        extra_logit_rows=[0, 1],
    )
    message = BatchMessage.of(batch, torch.arange(8, dtype=torch.int32).reshape(1, 8))
    check_rebuilt(message, batch)
    with pytest.raises(ValueError, match=r"extra_logit_rows \[\].*\[0, 1\]"):
        check_rebuilt(message, replace(batch, extra_logit_rows=[]))
    with pytest.raises(ValueError, match=r"len\(input_ids\) 2"):
        check_rebuilt(message, replace(batch, input_ids=batch.input_ids[:2]))
