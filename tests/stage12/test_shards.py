"""Stage 12 (graded): how a model splits, checked in one process (no group needed: loading
communicates with nobody). Every rank's slices, put back together, are the checkpoint's tensors;
heads that cannot be split are refused with both numbers in the message; each embedding id is
looked up by exactly the rank that owns it; a follower rebuilds the batch rank 0 broadcast,
field for field, with every table row whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from s00_foundation.config import ModelConfig
from s00_foundation.forward_batch import ForwardBatch, ForwardMode
from s12_tensor_parallel.engine import TPEngine
from s12_tensor_parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, head_ranges
from s12_tensor_parallel.parallel_state import TPGroup
from s12_tensor_parallel.tp_worker import BatchMessage
from s12_tensor_parallel.weight_loader import load_tp_model


def group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank, size, torch.device("cpu"))


def test_heads_split_and_kv_heads_replicate():
    # 8 query heads, 4 KV heads, 2 ranks: 4 + 2 each
    got = [tuple(map(list, head_ranges(8, 4, group(r, 2)))) for r in range(2)]
    assert got == [([0, 1, 2, 3], [0, 1]), ([4, 5, 6, 7], [2, 3])], (
        f"8 query heads, 4 KV heads on 2 ranks: (query heads, KV heads) per rank should be 4 consecutive query "
        f"heads and 2 consecutive KV heads each (rank r: q [4r, 4r + 4), KV [2r, 2r + 2)), got {got}"
    )
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
    except AssertionError as error:  # the learner's own assert: its message would read as this test's
        pytest.fail(
            f"head_ranges({heads} query heads, {kv_heads} KV heads) on tp_size={tp} refused with an assert "
            f"(AssertionError: {error}); raise ValueError instead: the engine reports a ValueError before any process "
            "starts, and `python -O` drops asserts"
        )
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
        given = ids.clone()  # each rank its own copy: one rank's lookup must not change the next rank's ids
        try:
            parts.append(embedding(given))
        except IndexError as error:  # an id past its shard (not NotImplementedError: that says "not written yet")
            pytest.fail(
                f"{owned}; looking up ids 0..{vocab - 1} raised {error!r}: a rank looks up only the ids it owns, id i "
                f"at row i - {shard.start} of its shard"
            )
        assert torch.equal(given, ids), (
            f"{owned}; looking up ids {ids.tolist()} changed them in place to {given.tolist()}: they are the batch's "
            "input_ids, which the caller still owns; build the shard's local ids in a new tensor (torch.where)"
        )
        wrong = [i for i in range(vocab) if (parts[-1][i] != 0).any() != (shard.start <= i < shard.stop)]
        assert not wrong, (
            f"{owned}; its part for ids {wrong} is wrong: a rank writes the rows of the ids it owns, zeros for all "
            "others (the all-reduce adds every rank's part)"
        )
    torch.testing.assert_close(sum(parts), table[ids], msg=lambda m: f"tp={tp}: the ranks' parts added up: {m}")


class Recording(NoCommunication):
    """A rank of a group in one process that counts the collectives it joins (``counts``, the
    group's own field); its gather gives rank 0 a copy of its own part for every rank (a test
    reads only the shape and dtype), None elsewhere."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.counts["all_reduce"] += 1
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        self.counts["gather"] += 1
        return torch.cat([x] * self.size, dim=-1) if self.is_first else None


def filled(layer: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    for param in layer.parameters():
        param.data = torch.randn(param.shape).to(dtype)
    return layer


def test_every_rank_joins_every_collective_whatever_it_holds():
    # Rank 1 of 2 owns ids [5, 10) of a 10-id vocabulary; the batch's ids are all rank 0's.
    vocab, hidden, ids, h = 10, 4, torch.tensor([0, 1, 2]), torch.randn(3, 4)
    layers = {  # name: (the layer on a rank, its input, the one collective it joins, in the lesson's words)
        "VocabParallelEmbedding": (
            lambda tp: VocabParallelEmbedding("embed", vocab, hidden, tp),
            ids,
            "all_reduce",
            "the embedding's all-reduce",
        ),
        "RowParallelLinear": (
            lambda tp: RowParallelLinear("o_proj", 8, hidden, True, tp),
            h,
            "all_reduce",
            "the row-parallel all-reduce",
        ),
        "ParallelLMHead": (
            lambda tp: ParallelLMHead("lm_head", vocab, hidden, tp, None),
            h,
            "gather",
            "the logits' gather",
        ),
    }
    for name, (make, x, collective, what) in layers.items():
        follower = Recording(1, 2, torch.device("cpu"))
        out = filled(make(follower))(x)
        assert dict(follower.counts) == {collective: 1}, (
            f"rank 1 of 2: {name}'s forward joined the collectives {dict(follower.counts)}, expected one {collective} "
            f"({what}): every rank joins every collective of a forward, whatever ids or rows it holds (here none "
            "of the batch's ids are rank 1's; ParallelLMHead: a follower returns None only after joining the "
            "gather). A rank that skips one leaves the others waiting inside it until the group's timeout ('Timed "
            "out waiting ... for recv'), or pairs their next collective with the wrong one"
        )
        if name == "VocabParallelEmbedding":
            assert not out.any(), f"rank 1 owns none of the ids {ids.tolist()}: its part should be zeros, got {out}"
        if name == "ParallelLMHead":
            assert out is None, f"ParallelLMHead on rank 1 of 2 returned {type(out).__name__}: only rank 0 gets logits"


@pytest.mark.parametrize("tp", [1, 2])
def test_the_layers_keep_the_models_dtype_and_the_logits_are_float32(tp):
    # A bfloat16 model (the GPU's dtype): 9 ids on 2 ranks, shards of 5, the last id of rank 1's padding.
    rank0 = Recording(0, tp, torch.device("cpu"))
    vocab, hidden = 9, 4
    embedding = filled(VocabParallelEmbedding("embed", vocab, hidden, rank0), torch.bfloat16)
    x = embedding(torch.tensor([0, 3, 4]))
    assert x.dtype == torch.bfloat16, (
        f"tp={tp}: a bfloat16 embedding table gave a {x.dtype} hidden state: the mask multiplies in the table's "
        "dtype (mine.to(weight.dtype)); a float32 mask promotes it, and the next bfloat16 layer refuses it"
    )
    head = filled(ParallelLMHead("lm_head", vocab, hidden, rank0, None), torch.bfloat16)
    logits = head(x)
    got = None if logits is None else (logits.dtype, tuple(logits.shape))
    assert got == (torch.float32, (3, vocab)), (
        f"tp={tp}: rank 0's ParallelLMHead on a bfloat16 model gave logits of (dtype, shape) {got}, expected "
        f"float32 of shape (3, {vocab}): rank 0 samples and scores log-probabilities from float32 logits, as one "
        "device does (compute_logits' .float()), every rank's slice gathered, the padding past the vocabulary cut off"
    )
    assert logits is not None
    own = F.linear(x, head.weight).float()
    torch.testing.assert_close(
        logits[:, : own.shape[1]],
        own,
        msg=lambda m: (
            f"tp={tp}: the gathered logits should start with rank 0's slice of the vocabulary (ids 0.."
            f"{own.shape[1] - 1}): the padding is the last rows of the last slice, so the cut keeps "
            f"logits[:, :vocab_size]. {m}"
        ),
    )


def test_a_row_parallel_layer_adds_its_bias_once_after_the_sum():
    # An all-reduce of 2 ranks whose partial products are equal (the test's stand-in: twice this rank's).
    class Doubling(Recording):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.size

    layer = filled(RowParallelLinear("o_proj", 8, 4, True, Doubling(0, 2, torch.device("cpu"))))
    x = torch.randn(3, 4)
    torch.testing.assert_close(
        layer(x),
        2 * F.linear(x, layer.weight) + layer.bias,
        msg=lambda m: (
            "RowParallelLinear with a bias, rank 0 of 2: the output should be the all-reduce of the partial products "
            "plus the bias once (added before the all-reduce, each rank's copy is summed: tp_size times). " + m
        ),
    )


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


def test_a_table_row_reused_by_another_request_is_written_whole_again():
    # Step 1: a request in row 1 decodes its 7th token. It finishes; step 2: a new request, in the
    # same row, prefills 3 tokens into slots the allocator chose again.
    follower = Follower(2, 16)
    steps = [([1], [7], [1], [30, 31, 32, 33, 34, 35, 36]), ([1], [3], [3], [50, 51, 52])]
    for rows, seq_lens, extend_lens, slots in steps:
        table = torch.zeros(2, 16, dtype=torch.int32)
        table[rows[0], : len(slots)] = torch.tensor(slots)
        n = extend_lens[0]
        batch = ForwardBatch(
            input_ids=torch.arange(n),
            positions=torch.arange(seq_lens[0] - n, seq_lens[0]),
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            attn_backend=None,
            req_pool_indices=torch.tensor(rows),
            out_cache_loc=torch.tensor(slots[-n:]),
        )
        BatchMessage.of(batch, table).to_forward_batch(follower)
    got = follower.req_to_token_pool.req_to_token[1, :3].tolist()
    assert got == [50, 51, 52], (
        f"row 1's first 3 slots on the follower are {got} after the new request's step, rank 0's [50, 51, 52]: "
        "a row freed by one request is reused by another, so a follower writes every request's whole table row "
        "every step (table_rows), keeping nothing from an earlier step"
    )
