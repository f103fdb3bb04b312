"""The parallel layers: each rank holds a slice of a weight and computes a slice of the result.

A linear ``y = x W^T`` (W is [out, in]) splits two ways (SGLang's ``layers/linear.py``)::

    column-parallel: W's output rows split     rank r: y_r = x W_r^T          y = [y_0 | y_1]   no communication
    row-parallel:    W's input columns split   rank r: p_r = x_r W_r^T        y = p_0 + p_1     one all-reduce

Megatron's pairing makes one all-reduce per block: a column-parallel layer's output slice is
exactly the input slice the next row-parallel layer needs, so nothing moves in between::

    attention: qkv_proj (column: each rank its heads) -> attention on its heads -> o_proj (row) -> all-reduce
    MLP:       gate_up_proj (column)                  -> silu(gate) * up        -> down_proj (row) -> all-reduce

The vocabulary splits too: the embedding table by rows (each rank looks up the ids it owns,
zeros elsewhere, one all-reduce), and the LM head by rows of W (each rank the logits of its
slice of the vocabulary, gathered on rank 0, the only rank that samples).

Each layer names the checkpoint tensors it is cut from (``Shard``): the loader (weight_loader.py)
reads just those slices from the safetensors files, so a rank never holds the full weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .parallel_state import TPGroup


@dataclass(frozen=True)
class Shard:
    """Rows ``start:stop`` (dim 0) or columns (dim 1) of the checkpoint tensor ``name`` (relative
    to the layer's parent module, without ``.weight``/``.bias``). Only a ``padded`` shard (the
    last slice of a vocabulary that does not divide by the TP size) may pass the tensor's end:
    the missing rows are zeros. Any other shard past the end is a split gone wrong."""

    name: str
    dim: int
    start: int
    stop: int
    padded: bool = False

    @property
    def size(self) -> int:
        return self.stop - self.start


def split(n: int, tp: TPGroup) -> Shard:
    """This rank's equal part of ``n`` rows (``n`` divides by the TP size: rank_config refuses a model
    whose heads or MLP do not)."""
    part = n // tp.size
    return Shard("", 0, tp.rank * part, (tp.rank + 1) * part)


def head_ranges(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[range, range]:
    """The query heads and the KV heads this rank computes.

    Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
    with fewer (GQA: 2 KV heads, 4 ranks) each KV head is replicated on tp_size / num_kv_heads
    ranks, the ones whose query heads read it. Anything else cannot be split: a clear error."""
    # BEGIN EXERCISE: each rank's query heads and KV heads, KV heads replicated when fewer than ranks [#heads]
    if num_heads % tp.size:
        raise ValueError(
            f"num_attention_heads={num_heads} does not divide by tp_size={tp.size}: each rank must hold whole heads"
        )
    q = num_heads // tp.size
    if num_kv_heads >= tp.size:
        if num_kv_heads % tp.size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} does not divide by tp_size={tp.size}")
        kv = num_kv_heads // tp.size
        return range(tp.rank * q, (tp.rank + 1) * q), range(tp.rank * kv, (tp.rank + 1) * kv)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} is fewer than tp_size={tp.size} and does not divide it: "
            "KV heads can only be replicated a whole number of times"
        )
    replicas = tp.size // num_kv_heads
    kv_head = tp.rank // replicas
    return range(tp.rank * q, (tp.rank + 1) * q), range(kv_head, kv_head + 1)
    # END EXERCISE


class ColumnParallelLinear(nn.Module):
    """Output rows split: this rank computes its ``shards``' rows, concatenated (one shard for a
    plain layer; gate and up for ``gate_up_proj``; this rank's q, k and v heads for ``qkv_proj``).
    No communication."""

    def __init__(self, in_features: int, shards: list[Shard], bias: bool):
        super().__init__()
        self.shards = shards
        out = sum(s.size for s in shards)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def weight_shards(self, param: str) -> list[Shard]:
        return self.shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input columns split: this rank multiplies its slice of the input (what the column-parallel
    layer before it produced) by its columns of W; the partial sums are all-reduced. The bias is
    added once, after the sum."""

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        part = split(in_features, tp)
        self.shard = Shard(name, 1, part.start, part.stop)
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, part.size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def weight_shards(self, param: str) -> list[Shard]:
        return [self.shard] if param == "weight" else [Shard(self.shard.name, 0, 0, self.weight.shape[0])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN EXERCISE: the partial product, summed over the ranks, then the bias [#row-parallel]
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
        # END EXERCISE


def vocab_shard(name: str, vocab_size: int, tp: TPGroup) -> Shard:
    """This rank's rows of a [vocab, hidden] table: ceil(vocab / tp) each, the last padded with zeros."""
    part = -(-vocab_size // tp.size)
    return Shard(name, 0, tp.rank * part, (tp.rank + 1) * part, padded=True)


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by rows: this rank looks up the ids in its range and writes
    zeros for the others; the all-reduce fills every row from the rank that owns its id (every
    rank joins it, even one that owns none of the batch's ids)."""

    def __init__(self, name: str, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.shard = vocab_shard(name, vocab_size, tp)
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size), requires_grad=False)

    def weight_shards(self, param: str) -> list[Shard]:
        return [self.shard]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # BEGIN EXERCISE: look up the ids this rank owns, zeros for the rest, all-reduce [#vocab-parallel]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.shard.start) & (ids < self.shard.stop)
        local = torch.where(mine, ids - self.shard.start, 0)
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)
        # END EXERCISE


class ParallelLMHead(nn.Module):
    """Logits over this rank's slice of the vocabulary, gathered on rank 0 (which samples); the
    padding rows of the last slice are cut off. Tied models pass the embedding's weight."""

    def __init__(self, name: str, vocab_size: int, hidden_size: int, tp: TPGroup, tied: VocabParallelEmbedding | None):
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.shard = vocab_shard(name, vocab_size, tp)
        if tied is not None:
            self.weight = tied.weight  # the same rows: both split the vocabulary the same way
        else:
            self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size), requires_grad=False)

    def weight_shards(self, param: str) -> list[Shard]:
        return [self.shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [rows, vocab] on rank 0, whatever the model's dtype; None on the other
        ranks, which join the gather all the same."""
        # BEGIN EXERCISE: this rank's logits, gathered on rank 0, the padding cut off [#lm-head]
        logits = self.tp.gather_to_first(F.linear(x, self.weight).float())
        return None if logits is None else logits[:, : self.vocab_size]
        # END EXERCISE
