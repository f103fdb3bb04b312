"""The batched sampler: greedy is exact argmax, sampling follows the (filtered) softmax, and
every request draws from its own seeded generator."""

from __future__ import annotations

import pytest
import torch

from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampler import min_p_mask, sample, top_k_mask, top_p_mask
from s02_request_and_sampling.sampling_params import SamplingParams

N_DRAWS = 20_000  # one row per draw, each with its own seed; all in one batched call
MIN_P_VALUE = 1e-6  # a correct sampler fails the chi-square check about once in a million runs


def make_reqs(params: list[SamplingParams]) -> list[Req]:
    return [Req(rid=i, origin_input_ids=[0], sampling_params=p) for i, p in enumerate(params)]


def sample_tokens(logits: torch.Tensor, reqs: list[Req]) -> list[int]:
    out = sample(logits, reqs)
    assert isinstance(out, torch.Tensor) and out.shape == (len(reqs),), (
        f"sample() should return a tensor of shape [{len(reqs)}] (one token per request), got {out!r:.100}"
    )
    assert not out.is_floating_point(), f"sample() should return integer token ids, got dtype {out.dtype}"
    return out.tolist()


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(a chi-square this large | the draws really follow ``probs``); only tokens with p > 0."""
    n = counts.sum()
    support = probs > 0
    expected = n * probs[support].double()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def draw_many(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Counts per token of N_DRAWS draws from one distribution (seeds 0..N_DRAWS-1)."""
    reqs = make_reqs([SamplingParams(**{**params.__dict__, "seed": i}) for i in range(N_DRAWS)])
    tokens = torch.tensor(sample_tokens(logits_row.expand(N_DRAWS, -1).clone(), reqs))
    return torch.bincount(tokens, minlength=logits_row.numel())


def describe(counts: torch.Tensor, probs: torch.Tensor) -> str:
    n = int(counts.sum())
    return ", ".join(f"token {t}: {int(c) / n:.3f} vs {float(p):.3f}" for t, (c, p) in enumerate(zip(counts, probs)))


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_equals_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen) * 5
    logits[1, 17] = 1e4  # a huge logit: a softmax would saturate, argmax must not care
    logits[2, :500] = float("-inf")  # masked-out tokens
    logits[3, 42] = logits[3].max() + 1e-3  # a near tie, decided by 0.001
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0, top_p=0.5)] * 2
    got = sample_tokens(logits, make_reqs(params))
    expected = logits.argmax(dim=-1).tolist()
    for row, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"row {row} is greedy ({params[row]}): expected argmax token {e}, your sampler picked {g}"


def test_greedy_rows_stay_exact_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=2.0, top_k=1),  # top_k=1 is greedy whatever the temperature
        SamplingParams(temperature=0.5, top_p=0.8, seed=2),
        SamplingParams(temperature=0.0, min_p=0.2),
        SamplingParams(temperature=1.3, top_k=20, min_p=0.05, seed=3),
    ]
    reqs = make_reqs(params)
    for step in range(20):
        logits = torch.randn(len(params), 300, generator=gen) * 2
        got = sample_tokens(logits, reqs)
        for row, p in enumerate(params):
            if p.is_greedy:
                assert got[row] == int(logits[row].argmax()), (
                    f"step {step}, row {row} ({p}) is greedy inside a batch with sampled rows: expected argmax "
                    f"token {int(logits[row].argmax())}, your sampler picked {got[row]}"
                )
            else:
                assert 0 <= got[row] < 300, (
                    f"step {step}, row {row} ({p}): your sampler picked token {got[row]}, outside the vocabulary of 300"
                    + empty_filters(logits[row], p)
                )


def empty_filters(logits_row: torch.Tensor, params: SamplingParams) -> str:
    """Why a sampled row may have had nothing to draw from: the filters that dropped its most likely token."""
    probs = torch.softmax(logits_row / params.temperature, dim=-1)[None]
    masks = {
        "top_k_mask": lambda: top_k_mask(probs, torch.tensor([params.top_k])),
        "top_p_mask": lambda: top_p_mask(probs, torch.tensor([params.top_p])),
        "min_p_mask": lambda: min_p_mask(probs, torch.tensor([params.min_p])),
    }
    dropped = [name for name, mask in masks.items() if not bool(mask()[0, int(probs.argmax())])]
    if not dropped:
        return ""
    return (
        f": {', '.join(dropped)} dropped the most likely token, so the kept set may be empty. Every filter keeps "
        "at least the most likely token (top-p: a token stays when the tokens MORE likely than it hold less than "
        "top_p; min-p: relative to the most likely token's probability)"
    )


# --- the sampled distribution -----------------------------------------------------------------

LOGITS = torch.tensor([1.0, 2.0, 0.0, -0.5, 1.5, -1.0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_follow_softmax_over_temperature(temperature):
    probs = torch.softmax(LOGITS / temperature, dim=-1)
    counts = draw_many(LOGITS, SamplingParams(temperature=temperature))
    p_value = chi_square_p_value(counts, probs)
    assert p_value > MIN_P_VALUE, (
        f"temperature={temperature}: {N_DRAWS} draws do not follow softmax(logits / temperature) "
        f"(chi-square p-value {p_value:.1e}); sampled vs expected frequencies: {describe(counts, probs)}"
    )


# Filters act on the temperature-scaled distribution. softmax(LOGITS / T) is
#   T=2.0: [0.186, 0.306, 0.113, 0.088, 0.239, 0.068]  min_p=0.33 -> p >= 0.101 -> tokens {0, 1, 2, 4}
#   T=0.5: [0.088, 0.653, 0.012, 0.004, 0.240, 0.002]  top_p=0.85 -> mass before token 0 is 0.893 -> {1, 4}
# while at temperature 1 the same filters would keep {0, 1, 4} and {0, 1, 4}.
SCALED = [(dict(temperature=2.0, min_p=0.33), {0, 1, 2, 4}), (dict(temperature=0.5, top_p=0.85), {1, 4})]


@pytest.mark.parametrize("kwargs,kept", SCALED, ids=["min_p_at_T2", "top_p_at_T0.5"])
def test_filters_apply_to_the_temperature_scaled_distribution(kwargs, kept):
    probs = torch.softmax(LOGITS / kwargs["temperature"], dim=-1)
    keep = torch.zeros(len(LOGITS), dtype=torch.bool)
    keep[sorted(kept)] = True
    expected = torch.where(keep, probs, 0.0) / probs[keep].sum()
    counts = draw_many(LOGITS, SamplingParams(**kwargs))
    outside = sorted(set(torch.nonzero(counts).flatten().tolist()) - kept)
    assert not outside, (
        f"{kwargs} should only ever produce tokens {sorted(kept)} (filter the softmax of logits / temperature), "
        f"your sampler also produced {outside}"
    )
    p_value = chi_square_p_value(counts, expected)
    assert p_value > MIN_P_VALUE, (
        f"{kwargs}: the kept tokens should be drawn in proportion to their probability; chi-square p-value "
        f"{p_value:.1e}; sampled vs expected: {describe(counts, expected)}"
    )


# Logits whose softmax at temperature 0.8 is (before the shuffle below)
#   [0.309, 0.213, 0.156, 0.114, 0.083, 0.061, 0.033, 0.017, 0.011, 0.003]
# top_k=7 keeps 7 tokens; top_p=0.85 keeps 5 (the mass before the 6th is 0.875); min_p=0.12 keeps
# the 6 with p >= 0.12 * 0.309 = 0.037. Together - whether applied to the same distribution or one
# after another - they keep the 5 most likely tokens, drawn in proportion to their probability.
FILTER_LOGITS = torch.tensor([2.0, 1.7, 1.45, 1.2, 0.95, 0.7, 0.2, -0.3, -0.7, -1.6])
SHUFFLE = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]


def test_sampled_frequencies_follow_the_filtered_softmax():
    logits = FILTER_LOGITS[SHUFFLE]
    probs = torch.softmax(logits / 0.8, dim=-1)
    keep = probs >= probs.sort(descending=True).values[4]  # the 5 most likely
    expected = torch.where(keep, probs, 0.0)
    expected = expected / expected.sum()
    counts = draw_many(logits, SamplingParams(temperature=0.8, top_k=7, top_p=0.85, min_p=0.12))
    outside = sorted(set(torch.nonzero(counts).flatten().tolist()) - set(torch.nonzero(keep).flatten().tolist()))
    assert not outside, (
        f"temperature=0.8, top_k=7, top_p=0.85, min_p=0.12 should only ever produce tokens "
        f"{sorted(torch.nonzero(keep).flatten().tolist())}, your sampler also produced {outside}"
    )
    p_value = chi_square_p_value(counts, expected)
    assert p_value > MIN_P_VALUE, (
        f"with top_k/top_p/min_p the kept tokens should be drawn in proportion to their (renormalised) "
        f"probability; chi-square p-value {p_value:.1e}; sampled vs expected: {describe(counts, expected)}"
    )


# Each row of one batch with a filter of its own over FILTER_LOGITS at temperature 0.8: row 0 none
# (all 10 tokens), top_k=2 (the 2 likeliest), top_p=0.6 (3: the mass before the 4th is 0.678),
# min_p=0.3 (4: p >= 0.3 * 0.309).
PER_ROW_FILTERS = [({}, 10), ({"top_k": 2}, 2), ({"top_p": 0.6}, 3), ({"min_p": 0.3}, 4)]


def test_each_row_is_filtered_by_its_own_requests_settings():
    logits = FILTER_LOGITS[SHUFFLE]
    ranked = torch.softmax(logits / 0.8, dim=-1).argsort(descending=True).tolist()
    draws = 500
    params = [
        SamplingParams(temperature=0.8, seed=seed, **kwargs) for kwargs, _ in PER_ROW_FILTERS for seed in range(draws)
    ]
    tokens = sample_tokens(logits.expand(len(params), -1).clone(), make_reqs(params))
    for i, (kwargs, n_kept) in enumerate(PER_ROW_FILTERS):
        drawn = set(tokens[i * draws : (i + 1) * draws])
        kept = set(ranked[:n_kept])
        what = ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "no filter"
        outside = sorted(drawn - kept)
        assert not outside, (
            f"in a batch whose rows each have their own filter, the rows with {what} drew {outside}, outside their "
            f"own kept tokens {sorted(kept)}: apply each request's top_k/top_p/min_p to its own row, and a filter "
            "whenever ANY row uses it (row 0 here uses none)"
        )
        assert n_kept < 10 or len(drawn) >= 7, (
            f"the rows with no filter drew only {sorted(drawn)} in {draws} draws: another row's filter changed them"
        )


def test_extreme_but_valid_values_still_draw_a_real_token():
    # Each value is accepted by SamplingParams; the sampler's float32 arithmetic must not turn it
    # into "keep nothing" (a draw past the vocabulary: a token id the model cannot embed).
    logits = FILTER_LOGITS[SHUFFLE]
    best = int(logits.argmax())
    for kwargs in (dict(top_p=1e-320), dict(top_p=5e-324, min_p=1.0), dict(temperature=1e-3, top_p=1e-45)):
        params = [SamplingParams(**{"temperature": 1.0, **kwargs}, seed=seed) for seed in range(8)]
        tokens = sample_tokens(logits.expand(8, -1).clone(), make_reqs(params))
        assert tokens == [best] * 8, (
            f"{params[0]} should always draw the most likely token {best} of {len(logits)} (the only one such a "
            f"filter keeps), your sampler drew {tokens}"
        )


# --- seeds ------------------------------------------------------------------------------------


def logits_stream(steps: int, batch: int, vocab: int = 50, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, vocab, generator=gen) for _ in range(steps)]


def run(reqs: list[Req], stream: list[torch.Tensor]) -> list[list[int]]:
    """Sample every step; returns the token sequence of each request."""
    out: list[list[int]] = [[] for _ in reqs]
    for logits in stream:
        for i, token in enumerate(sample_tokens(logits, reqs)):
            out[i].append(token)
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    mine = logits_stream(30, 1, seed=7)
    alone = run(make_reqs([params]), mine)[0]

    others = logits_stream(30, 3, seed=8)
    batch = [torch.cat([o[:2], m, o[2:]]) for o, m in zip(others, mine)]  # our request is row 2
    neighbours = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    reqs = make_reqs(neighbours[:2] + [params] + neighbours[2:])
    together = run(reqs, batch)[2]
    for step, (a, b) in enumerate(zip(alone, together)):
        assert a == b, (
            f"a request with seed=1234 sampled token {a} at step {step} when alone, but {b} when it shared the "
            "batch with 3 other requests: draw each row with its own request's generator (req.generator), "
            "never a shared or global random state; and no other row's settings may change this row (a neighbour "
            "has top_k=5, the others top_k=-1: off)"
        )
    assert len(set(alone)) > 5, (
        f"30 sampled steps of a near-uniform 50-token distribution gave only {sorted(set(alone))}: "
        "the request's generator should move on from step to step (do not re-seed it every step)"
    )


def test_different_seeds_give_different_tokens():
    stream = logits_stream(1, 1, seed=3) * 20  # the same near-uniform logits at every step
    sequences = {seed: run(make_reqs([SamplingParams(seed=seed)]), stream)[0] for seed in (0, 1, 2, 3, 99)}
    for seed, tokens in sequences.items():
        again = run(make_reqs([SamplingParams(seed=seed)]), stream)[0]
        assert tokens == again, f"seed={seed} gave {tokens} and then {again} on the same logits: a seed must reproduce"
        assert len(set(tokens)) > 5, (
            f"seed={seed}: 20 draws from the same near-uniform 50-token distribution gave only {sorted(set(tokens))}: "
            "the request's generator should move on from draw to draw (seed it once, when the request is made)"
        )
    distinct = {tuple(t) for t in sequences.values()}
    assert len(distinct) == len(sequences), (
        f"5 different seeds gave only {len(distinct)} different 20-token sequences on a near-uniform distribution: "
        "seed each request's generator from its own seed"
    )


def test_unseeded_request_records_a_seed_that_reproduces_it():
    stream = logits_stream(20, 1, seed=4)
    first, second = make_reqs([SamplingParams(), SamplingParams()])
    assert isinstance(first.seed, int) and first.seed != second.seed, (
        f"requests without a seed should each draw a fresh one and record it in req.seed; got {first.seed!r} and "
        f"{second.seed!r}"
    )
    tokens = run([first], stream)[0]
    replay = run(make_reqs([SamplingParams(seed=first.seed)]), stream)[0]
    assert tokens == replay, f"re-running with SamplingParams(seed=req.seed) should reproduce {tokens}, got {replay}"
