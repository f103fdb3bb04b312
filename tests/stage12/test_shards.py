"""Stage 12 (graded): how a model splits, checked in one process (no group needed: loading
communicates with nobody). Every rank's slices, put back together, are the checkpoint's tensors;
heads that cannot be split are refused with both numbers in the message; each embedding id is
looked up by exactly the rank that owns it; a follower rebuilds the batch rank 0 broadcast,
field for field, with every table row whole."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from s00_foundation.config import ModelConfig
from s00_foundation.forward_batch import ForwardBatch, ForwardMode
from s12_tensor_parallel.engine import TPEngine
from s12_tensor_parallel.layers import VocabParallelEmbedding, head_ranges
from s12_tensor_parallel.parallel_state import TPGroup
from s12_tensor_parallel.tp_worker import BatchMessage
from s12_tensor_parallel.weight_loader import load_tp_model


def group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank, size, torch.device("cpu"))


def test_heads_split_and_kv_heads_replicate():
    # 8 query heads, 4 KV heads, 2 ranks: 4 + 2 each
    assert [tuple(map(list, head_ranges(8, 4, group(r, 2)))) for r in range(2)] == [
        ([0, 1, 2, 3], [0, 1]),
        ([4, 5, 6, 7], [2, 3]),
    ]
    # 4 query heads, 2 KV heads, 4 ranks: each KV head on the two ranks whose query heads read it
    got = [tuple(map(list, head_ranges(4, 2, group(r, 4)))) for r in range(4)]
    assert got == [([0], [0]), ([1], [0]), ([2], [1]), ([3], [1])], (
        f"4 query heads, 2 KV heads on 4 ranks: (query heads, KV heads) per rank should be query head r with "
        f"KV head r // 2 (each KV head replicated on 2 ranks), got {got}"
    )


# Each case breaks exactly one rule, so a refusal is right in whatever order the checks run:
# query heads that do not divide; KV heads, at least as many as ranks, that do not divide; KV
# heads, fewer than ranks, that the ranks cannot replicate whole (2 heads on 3 ranks).
UNSPLITTABLE = [(6, 4, 4, ("6", "4")), (8, 3, 2, ("3", "2")), (6, 2, 3, ("2", "3"))]


@pytest.mark.parametrize("heads, kv_heads, tp, named", UNSPLITTABLE)
def test_heads_that_cannot_split_are_refused_clearly(heads, kv_heads, tp, named):
    why = (
        f"{heads} query heads do not divide by {tp} ranks"
        if heads % tp
        else f"{kv_heads} KV heads neither divide by {tp} ranks nor can {tp} ranks replicate them whole"
    )
    try:
        got = head_ranges(heads, kv_heads, group(0, tp))
    except ValueError as error:
        message = str(error)
    else:
        pytest.fail(
            f"head_ranges({heads} query heads, {kv_heads} KV heads) on tp_size={tp} gave rank 0 "
            f"{tuple(map(list, got))}, but {why}: some heads would be on no rank. Raise ValueError naming the numbers"
        )
    assert all(n in message for n in named) and "tp_size" in message, (
        f"{heads} query heads, {kv_heads} KV heads, tp_size={tp}: the error should name the numbers that do not "
        f"divide and tp_size, got {message!r}"
    )


class NoCommunication(TPGroup):
    """A rank of a group in one process: its all-reduce returns this rank's own part, so a test
    can add the parts of every rank itself."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("tp", [2, 3])
def test_each_id_is_looked_up_by_the_one_rank_that_owns_it(tp):
    vocab, hidden = 10, 4  # 3 ranks: shards of 4 rows, [0, 4) [4, 8) [8, 12), the last two rows padding
    table = torch.arange(vocab * hidden, dtype=torch.float32).reshape(vocab, hidden) + 1
    ids = torch.arange(vocab)
    parts = []
    for rank in range(tp):
        embedding = VocabParallelEmbedding("embed", vocab, hidden, NoCommunication(rank, tp, torch.device("cpu")))
        shard = embedding.shard
        rows = table[shard.start : shard.stop]
        embedding.weight.data = torch.cat([rows, rows.new_zeros(shard.size - len(rows), hidden)])
        owned = f"rank {rank} of {tp} holds the embedding rows of ids [{shard.start}, {shard.stop})"
        try:
            parts.append(embedding(ids))
        except IndexError as error:  # an id past its shard (not NotImplementedError: that says "not written yet")
            pytest.fail(
                f"{owned}; looking up ids 0..{vocab - 1} raised {error!r}: a rank looks up only the ids it owns, id i "
                f"at row i - {shard.start} of its shard"
            )
        wrong = [i for i in range(vocab) if (parts[-1][i] != 0).any() != (shard.start <= i < shard.stop)]
        assert not wrong, (
            f"{owned}; its part for ids {wrong} is wrong: a rank writes the rows of the ids it owns, zeros for all "
            "others (the all-reduce adds every rank's part)"
        )
    torch.testing.assert_close(sum(parts), table[ids], msg=lambda m: f"tp={tp}: the ranks' parts added up: {m}")


@pytest.mark.parametrize("family, tp", [("llama", 2), ("qwen2", 2), ("qwen3", 4), ("llama_gqa_bias", 2), ("llama3", 2)])
def test_shards_reassemble_to_the_checkpoint(tiny_models_root, family, tp):
    path = tiny_models_root / family
    full = load_file(str(path / "model.safetensors"))
    config = ModelConfig.from_folder(path)
    ranks = [load_tp_model(path, group(r, tp), "cpu", torch.float32) for r in range(tp)]
    d, vocab = config.head_dim, config.vocab_size
    layer = [m.model.layers[1] for m in ranks]
    q_rows = config.num_attention_heads // tp * d
    kv_rows = max(1, config.num_key_value_heads // tp) * d

    def whole(name):
        return full[f"model.layers.1.{name}.weight"]

    parts = [a.self_attn.qkv_proj.weight.split([q_rows, kv_rows, kv_rows]) for a in layer]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole("self_attn.q_proj"), msg=f"{family}: q rows")
    replicas = max(1, tp // config.num_key_value_heads)  # ranks sharing one KV head: take each head once
    for i, name in ((1, "k_proj"), (2, "v_proj")):
        torch.testing.assert_close(
            torch.cat([p[i] for p in parts[::replicas]]), whole(f"self_attn.{name}"), msg=f"{family}: {name} rows"
        )
        for rank, p in enumerate(parts):  # every replica holds its KV head, not only the first of each
            first = rank - rank % replicas
            torch.testing.assert_close(
                p[i],
                parts[first][i],
                msg=lambda m, rank=rank, first=first, name=name: (
                    f"{family}, tp={tp}: rank {rank}'s {name} rows should be the KV head rank {first} holds (ranks "
                    f"{first}..{first + replicas - 1} share it: KV head rank // {replicas}): {m}"
                ),
            )
    torch.testing.assert_close(
        torch.cat([a.self_attn.o_proj.weight for a in layer], dim=1), whole("self_attn.o_proj"), msg="o_proj columns"
    )
    gate_up = [a.mlp.gate_up_proj.weight.chunk(2) for a in layer]
    torch.testing.assert_close(torch.cat([g for g, _ in gate_up]), whole("mlp.gate_proj"), msg="gate_proj rows")
    torch.testing.assert_close(torch.cat([u for _, u in gate_up]), whole("mlp.up_proj"), msg="up_proj rows")
    torch.testing.assert_close(
        torch.cat([a.mlp.down_proj.weight for a in layer], dim=1), whole("mlp.down_proj"), msg="down_proj columns"
    )
    embed = torch.cat([m.model.embed_tokens.weight for m in ranks])
    torch.testing.assert_close(embed[:vocab], full["model.embed_tokens.weight"], msg=f"{family}: embedding rows")
    assert not embed[vocab:].any(), f"{family}: the padding rows past the vocabulary ({vocab}) must be zeros"
    if not config.tie_word_embeddings:
        head = torch.cat([m.lm_head.weight for m in ranks])
        torch.testing.assert_close(head[:vocab], full["lm_head.weight"], msg=f"{family}: lm_head rows")
    assert ranks[0].config.num_key_value_heads == kv_rows // d, (
        f"{family}, tp={tp}: a rank's config should count its own KV heads (its KV pool is built from it)"
    )


def test_an_unsplittable_model_is_refused_before_any_process_starts(tiny_models_root):
    # qwen3's tiny model: 4 query heads, 2 KV heads; 3 ranks cannot split either
    with pytest.raises(ValueError) as error:
        TPEngine(str(tiny_models_root / "qwen3"), tp_size=3, pool_size=64)
    assert "tp_size=3" in str(error.value), f"the error should name tp_size=3: {error.value}"


class Follower:
    """What to_forward_batch reads of a follower's runner: its device, table and attention backend."""

    def __init__(self, rows: int, width: int):
        self.device = torch.device("cpu")
        self.req_to_token_pool = type("Pool", (), {"req_to_token": torch.full((rows, width), -1, dtype=torch.int32)})
        self.attn_backend = object()


def test_a_follower_rebuilds_rank_0s_batch_field_for_field():
    # Rank 0's step: request in row 2 decodes its 6th token (5 cached: its first 3 from the radix
    # cache, written by rank 0 in an earlier step), request in row 0 prefills 3 tokens after 2
    # cached, and asks for its prompt's logits (row 2 of the pass).
    table = torch.zeros(4, 16, dtype=torch.int32)
    table[2, :6] = torch.tensor([40, 41, 42, 7, 8, 9])
    table[0, :5] = torch.tensor([40, 41, 11, 12, 13])
    batch = ForwardBatch(
        input_ids=torch.tensor([5, 60, 61, 62]),
        positions=torch.tensor([5, 2, 3, 4]),
        extend_lens=[1, 3],
        seq_lens=[6, 5],
        attn_backend=None,
        req_pool_indices=torch.tensor([2, 0]),
        out_cache_loc=torch.tensor([9, 11, 12, 13]),
        extra_logit_rows=[1, 2],
    )
    message = BatchMessage.of(batch, table)
    follower = Follower(4, 16)
    rebuilt = message.to_forward_batch(follower)
    got = follower.req_to_token_pool.req_to_token
    for row, n in ((2, 6), (0, 5)):
        assert got[row, :n].tolist() == table[row, :n].tolist(), (
            f"table row {row} on the follower is {got[row, :n].tolist()}, rank 0's {table[row, :n].tolist()}: write "
            "every slot of each request's row (table_rows), not only this pass's out_cache_loc; its cached prefix "
            "sits in slots an earlier step (or the radix cache) chose"
        )
    assert rebuilt.forward_mode is ForwardMode.MIXED and rebuilt.attn_backend is follower.attn_backend
    for name in ("input_ids", "positions", "req_pool_indices", "out_cache_loc"):
        mine, sent = getattr(rebuilt, name), getattr(batch, name)
        assert isinstance(mine, torch.Tensor) and mine.tolist() == sent.tolist() and mine.dtype == torch.int64, (
            f"the follower's {name} should be an int64 tensor {sent.tolist()} (rank 0's), got {mine!r}"
        )
    for name in ("extend_lens", "seq_lens", "extra_logit_rows"):
        assert list(getattr(rebuilt, name)) == list(getattr(batch, name)), (
            f"the follower's {name} is {getattr(rebuilt, name)!r}, rank 0's {getattr(batch, name)!r}: every rank "
            "runs the same batch (extra_logit_rows: every rank joins the gather of the prompt rows rank 0 scores)"
        )
