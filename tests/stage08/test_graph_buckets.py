"""Stage 8 (graded): which decode batches the graph runner takes, and which bucket each one gets."""

from __future__ import annotations

import pytest

from graph_helpers import runners
from reference import engine_model
from s00_foundation.forward_batch import ForwardBatch
from s08_cuda_graph.cuda_graph_runner import capture_bs_buckets, kv_len_buckets
from s08_cuda_graph.model_runner import GraphModelRunner


@pytest.mark.parametrize(
    "max_bs, expected",
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (12, [1, 2, 4, 8, 12]),
        (20, [1, 2, 4, 8, 16, 20]),
        (32, [1, 2, 4, 8, 16, 24, 32]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_capture_batch_sizes(max_bs, expected):
    got = capture_bs_buckets(max_bs)
    assert got == expected, (
        f"cuda_graph_max_bs={max_bs}: the graphs should be captured for batch sizes {expected} "
        "(1, 2, 4, 8, then steps of 8, and max_bs itself as the largest), got " + repr(got)
    )


def test_kv_len_buckets_double_up_to_the_table_width():
    for width, expected in [(1000, [64, 128, 256, 512, 1000]), (256, [64, 128, 256]), (40, [40])]:
        got = kv_len_buckets(width)
        assert got == expected, (
            f"kv_len_buckets({width}) should be {expected}: key lengths doubling from 64 while below the table "
            f"width, then the width itself, so every sequence the table holds has a bucket; got {got}"
        )


def test_key_lengths_stop_at_cuda_graph_max_kv_len(tiny_models_root):
    """Longer sequences than the largest key bucket decode eagerly: a bucket at the full table
    width would gather [bs, width] keys in every layer."""
    model = engine_model(str(tiny_models_root / "llama"))
    runner = GraphModelRunner(
        model,
        pool_size=512,
        max_running_requests=8,
        max_context_len=1000,
        attention_backend="torch",
        cuda_graph_max_bs=4,
        cuda_graph_max_kv_len=200,
    )
    graph = runner.cuda_graph_runner
    assert graph.capture_kv_lens == [64, 128, 200], (
        f"key buckets up to cuda_graph_max_kv_len=200: got {graph.capture_kv_lens}"
    )
    assert len(graph.batches) == 3 * 3, f"every (bs, kv_len) bucket is set up at start: got {sorted(graph.batches)}"
    assert graph.can_run(decode_batch(runner, 3, seq_len=200)), (
        "a decode whose longest sequence fits the largest key bucket replays"
    )
    assert not graph.can_run(decode_batch(runner, 3, seq_len=201)), (
        "a decode with a sequence longer than cuda_graph_max_kv_len (201 > 200) must run eagerly"
    )
    for lengths in ([201, 5, 5], [5, 201, 5], [5, 5, 201]):
        batch = ForwardBatch.build([[65]] * 3, [n - 1 for n in lengths], runner.attn_backend)
        assert not graph.can_run(batch), (
            f"a decode of sequences of {lengths} tokens must run eagerly: its longest, wherever it stands, "
            "is longer than cuda_graph_max_kv_len=200 (check the longest of seq_lens, not one request's)"
        )


def decode_batch(runner, num_reqs: int, seq_len: int = 5) -> ForwardBatch:
    """A decode batch of ``num_reqs`` one-token requests (only its shape matters here)."""
    return ForwardBatch.build([[65]] * num_reqs, [seq_len - 1] * num_reqs, runner.attn_backend)


def test_bucket_choice_for_every_batch_size(tiny_models_root):
    runner, _ = runners(engine_model(str(tiny_models_root / "llama")), max_bs=20, max_running_requests=24)
    graph = runner.cuda_graph_runner
    buckets = [1, 2, 4, 8, 16, 20]
    for n in range(1, 22):
        batch = decode_batch(runner, n)
        if n > 20:
            assert not graph.can_run(batch), (
                f"a decode of {n} requests is larger than cuda_graph_max_bs=20: it must run eagerly"
            )
            continue
        assert graph.can_run(batch), (
            f"a decode of {n} requests fits cuda_graph_max_bs=20: the graph runner must take it"
        )
        expected = min(b for b in buckets if b >= n)
        got = graph.bucket_for(n, 5)[0]
        assert got == expected, (
            f"a decode of {n} requests goes to the smallest bucket that holds it, {expected}; got {got}"
        )


def test_bucket_choice_for_key_lengths(tiny_models_root):
    runner, _ = runners(engine_model(str(tiny_models_root / "llama")))  # table width 256: kv_len buckets 64, 128, 256
    graph = runner.cuda_graph_runner
    for seq_len, expected in [(1, 64), (64, 64), (65, 128), (128, 128), (129, 256), (256, 256)]:
        got = graph.bucket_for(3, seq_len)
        assert got == (4, expected), (
            f"3 requests, the longest with {seq_len} tokens: expected bucket (4, {expected}), got {got}"
        )


def test_prefill_and_mixed_batches_are_not_for_graphs(tiny_models_root):
    runner, _ = runners(engine_model(str(tiny_models_root / "llama")))
    graph = runner.cuda_graph_runner
    prefill = ForwardBatch.build([[65, 66, 67]], [0], runner.attn_backend)
    mixed = ForwardBatch.build([[65], [66, 67]], [4, 0], runner.attn_backend)
    assert not graph.can_run(prefill), "a prefill (3 new tokens) cannot replay a decode graph"
    assert not graph.can_run(mixed), "a batch mixing a decode and a prefill cannot replay a decode graph"
    assert graph.can_run(decode_batch(runner, 3)), "a decode of 3 requests fits the graphs (cuda_graph_max_bs=8)"
