"""top-k / top-p / min-p keep exactly the right token sets, checked on crafted distributions.

Each filter takes probabilities ``[B, V]`` and one parameter per row (a ``[B]`` tensor) and
returns a ``[B, V]`` boolean mask of the tokens it keeps.
"""

from __future__ import annotations

import pytest
import torch

from s02_request_and_sampling.sampler import min_p_mask, top_k_mask, top_p_mask

# Probabilities chosen so no cut falls on a rounding boundary. Sorted, row 0 is
#   token 3: 0.40, token 1: 0.30, token 4: 0.15, token 2: 0.10, token 0: 0.05
# with 0, 0.40, 0.70, 0.85, 0.95 of the mass strictly above each of them.
ROW = [0.05, 0.30, 0.10, 0.40, 0.15]
# Row 1 is the same distribution in another token order, so a filter that ignores which
# token is which (or only looks at row 0) is caught: token 0 <- 3, 1 <- 0, 2 <- 4, 3 <- 1, 4 <- 2.
PERM = [3, 0, 4, 1, 2]


def probs() -> torch.Tensor:
    base = torch.tensor(ROW)
    return torch.stack([base, base[PERM]])


def in_row1(tokens: set[int]) -> set[int]:
    """Where row 0's tokens sit in row 1."""
    return {PERM.index(t) for t in tokens}


def kept(mask: torch.Tensor, name: str, rows: int) -> list[set[int]]:
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool, (
        f"{name} should return a bool tensor, got {mask!r}"
    )
    assert mask.shape == (rows, len(ROW)), (
        f"{name} should return a [B, V] = {[rows, len(ROW)]} mask, got {list(mask.shape)}"
    )
    return [set(torch.nonzero(r).flatten().tolist()) for r in mask]


def check(name, got: list[set[int]], expected: list[set[int]], params):
    for row, (g, e) in enumerate(zip(got, expected)):
        assert g == e, (
            f"{name} with {params[row]} on row {row} (probabilities {[round(x, 3) for x in probs()[row].tolist()]}) "
            "should keep "
            f"tokens {sorted(e)}, your mask kept {sorted(g)}"
        )


TOP_K = [(1, {3}), (2, {3, 1}), (4, {3, 1, 4, 2}), (5, {0, 1, 2, 3, 4}), (50, {0, 1, 2, 3, 4}), (-1, {0, 1, 2, 3, 4})]


@pytest.mark.parametrize("k,expected", TOP_K, ids=[f"k={k}" for k, _ in TOP_K])
def test_top_k_keeps_the_k_most_likely(k, expected):
    got = kept(top_k_mask(probs(), torch.tensor([k, k])), "top_k_mask", 2)
    check("top_k_mask", got, [expected, in_row1(expected)], [f"top_k={k}"] * 2)


def test_top_k_uses_each_rows_own_k():
    got = kept(top_k_mask(probs(), torch.tensor([1, 3])), "top_k_mask", 2)
    check("top_k_mask", got, [{3}, in_row1({3, 1, 4})], ["top_k=1", "top_k=3"])


def test_top_k_keeps_exactly_k_when_probabilities_tie():
    # Three tokens tie at 0.3. A threshold at the k-th largest value (p >= kth) would keep all
    # three for k = 1 or 2: then top_k=1 would not be greedy, which the engine assumes (is_greedy).
    tied = torch.tensor([[0.3, 0.1, 0.3, 0.3], [0.3, 0.1, 0.3, 0.3]])
    mask = top_k_mask(tied, torch.tensor([1, 2]))
    for row, k in enumerate((1, 2)):
        got = sorted(torch.nonzero(mask[row]).flatten().tolist())
        assert len(got) == k and set(got) <= {0, 2, 3}, (
            f"top_k={k} on probabilities {tied[row].tolist()} (three tied at 0.3) should keep exactly {k} of the tied "
            f"tokens 0, 2, 3 (the sort breaks the tie), your mask kept {got}: keep the first k places of the sorted "
            "row, not every token at least as likely as the k-th"
        )


TOP_P = [
    (0.3, {3}),
    (0.5, {3, 1}),
    (0.75, {3, 1, 4}),
    (0.9, {3, 1, 4, 2}),
    (0.99, {0, 1, 2, 3, 4}),
    (1.0, {0, 1, 2, 3, 4}),
]


@pytest.mark.parametrize("p,expected", TOP_P, ids=[f"p={p}" for p, _ in TOP_P])
def test_top_p_keeps_smallest_set_reaching_p(p, expected):
    got = kept(top_p_mask(probs(), torch.tensor([p, p])), "top_p_mask", 2)
    check("top_p_mask", got, [expected, in_row1(expected)], [f"top_p={p}"] * 2)


def test_top_p_always_keeps_the_most_likely_token():
    peaked = torch.tensor([[0.01, 0.97, 0.01, 0.01]])
    got = torch.nonzero(top_p_mask(peaked, torch.tensor([0.05]))[0]).flatten().tolist()
    assert got == [1], (
        f"top_p=0.05 on {peaked[0].tolist()} should keep just the most likely token [1], your mask kept {got}"
    )


def test_top_p_keeps_the_most_likely_token_when_p_underflows_float32():
    # top_p=1e-320 is a valid value (> 0), but the sampler's float32 tensor holds it as 0.0: a mask
    # that keeps nothing would let the draw fall past the vocabulary (a token id that does not exist).
    peaked = torch.tensor([[0.01, 0.97, 0.01, 0.01]])
    got = torch.nonzero(top_p_mask(peaked, torch.tensor([1e-320]))[0]).flatten().tolist()
    assert got == [1], (
        f"top_p=1e-320 (0.0 in float32) on {peaked[0].tolist()} should still keep the most likely token [1], "
        f"your mask kept {got}"
    )


def test_top_p_of_1_keeps_every_token_even_where_float32_sums_past_1():
    # top_p=1 means "off". Over a 32000-token row, float32's running sum of the sorted probabilities
    # reaches 1.0 (rounded) before the last ~1000 tokens: "mass before < 1" would drop them.
    logits = torch.randn(1, 32000, generator=torch.Generator().manual_seed(0)) * 3
    row = torch.softmax(logits, dim=-1)
    dropped = int((~top_p_mask(row, torch.tensor([1.0]))).sum())
    assert dropped == 0, (
        f"top_p=1 (off) dropped {dropped} of 32000 tokens: float32 rounding makes the mass before the last tokens "
        "reach 1.0, so top_p >= 1 must keep the whole row whatever the sums say"
    )


def test_top_p_uses_each_rows_own_p():
    got = kept(top_p_mask(probs(), torch.tensor([0.9, 0.5])), "top_p_mask", 2)
    check("top_p_mask", got, [{3, 1, 4, 2}, in_row1({3, 1})], ["top_p=0.9", "top_p=0.5"])


MIN_P = [(0.0, {0, 1, 2, 3, 4}), (0.1, {0, 1, 2, 3, 4}), (0.3, {3, 1, 4}), (0.5, {3, 1}), (0.9, {3}), (1.0, {3})]


@pytest.mark.parametrize("m,expected", MIN_P, ids=[f"min_p={m}" for m, _ in MIN_P])
def test_min_p_keeps_tokens_near_the_top(m, expected):
    # min_p * 0.40 is the bar: 0.3 -> 0.12 keeps {0.40, 0.30, 0.15}; 0.5 -> 0.20 keeps {0.40, 0.30}.
    got = kept(min_p_mask(probs(), torch.tensor([m, m])), "min_p_mask", 2)
    check("min_p_mask", got, [expected, in_row1(expected)], [f"min_p={m}"] * 2)


def test_min_p_uses_each_rows_own_p():
    got = kept(min_p_mask(probs(), torch.tensor([0.5, 0.3])), "min_p_mask", 2)
    check("min_p_mask", got, [{3, 1}, in_row1({3, 1, 4})], ["min_p=0.5", "min_p=0.3"])


def test_filters_on_a_large_vocabulary():
    """The same rules at a realistic size, against a direct per-token computation."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 5000, generator=gen) * 3, dim=-1)
    order = p.argsort(dim=-1, descending=True)
    for row in range(3):
        k = [7, 100, 1234][row]
        expected_k = set(order[row, :k].tolist())
        got_k = set(torch.nonzero(top_k_mask(p, torch.tensor([7, 100, 1234]))[row]).flatten().tolist())
        assert got_k == expected_k, (
            f"top_k={k} on a 5000-token row kept {len(got_k)} tokens, expected exactly the {k} most likely"
        )

        sorted_p = p[row, order[row]]
        mass_before = sorted_p.double().cumsum(0) - sorted_p.double()
        top_p = [0.5, 0.8, 0.95][row]
        n = int((mass_before < top_p).sum())
        got_p = torch.nonzero(top_p_mask(p, torch.tensor([0.5, 0.8, 0.95]))[row]).flatten()
        # Allow one token of slack for float32 vs float64 rounding of the running sum.
        assert abs(len(got_p) - n) <= 1 and set(got_p.tolist()) <= set(order[row, : n + 1].tolist()), (
            f"top_p={top_p} on a 5000-token row should keep the {n} most likely tokens, your mask kept {len(got_p)} "
            "(or not the most likely ones)"
        )

        min_p = [0.5, 0.05, 0.001][row]
        expected_m = set(torch.nonzero(p[row] >= min_p * p[row].max()).flatten().tolist())
        got_m = set(torch.nonzero(min_p_mask(p, torch.tensor([0.5, 0.05, 0.001]))[row]).flatten().tolist())
        assert got_m == expected_m, (
            f"min_p={min_p} on a 5000-token row should keep the {len(expected_m)} tokens with p >= min_p * max p, "
            f"your mask kept {len(got_m)}"
        )
