"""The decode benchmark (s08 decode_latency.py; provided code, not graded): the context it gives
requests without a prefill, the K/V bytes a decode step must read, the device's read rate, and the
floor they give with the bare pass."""

from __future__ import annotations

import math

import torch

from s00_foundation.forward_batch import ForwardMode
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampling_params import SamplingParams
from s04_paged_kv_pool.engine import prepare_forward
from s04_paged_kv_pool.model_runner import ModelRunner
from s08_cuda_graph.decode_latency import (
    SMALL_SMOLLM2,
    fill_context,
    kv_bytes,
    memory_floor,
    memory_read_rate,
    random_model,
)
from s08_cuda_graph.model_runner import GraphModelRunner


def filled(runner, batch_size: int, context_len: int) -> list[Req]:
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    reqs = [Req(i, [100 + i] * context_len, params) for i in range(batch_size)]
    fill_context(runner, reqs, seed=1)
    return reqs


def test_fill_context_stores_each_prompt_but_its_last_token_and_the_next_pass_is_a_decode():
    model = random_model(SMALL_SMOLLM2, "cpu", torch.float32)
    runner = GraphModelRunner(model, 256, 1, 4, 64, disable_cuda_graph=True)
    free = runner.allocator.available_size()
    reqs = filled(runner, 3, 20)
    assert [r.cached_len for r in reqs] == [19] * 3
    assert runner.allocator.available_size() == free - 3 * 19, "19 slots a request, taken from the allocator"
    table, pool = runner.req_to_token_pool.req_to_token, runner.token_to_kv_pool
    slots = torch.cat([table[r.req_pool_idx, :19] for r in reqs])
    assert len(set(slots.tolist())) == 57 and 0 not in slots.tolist(), "distinct slots, never the dummy"
    for layer in range(model.config.num_hidden_layers):
        keys = pool.get_key_buffer(layer)[slots]
        assert keys.abs().sum(-1).min() > 0, f"layer {layer}: a stored position holds no K"
        assert torch.equal(pool.get_value_buffer(layer)[slots], pool.get_value_buffer(0)[slots])
    batch = prepare_forward(runner, reqs)
    assert batch.forward_mode is ForwardMode.DECODE and batch.prefix_lens == [19] * 3


def test_a_decode_over_the_filled_context_reads_it():
    """Stage 4's loop and stage 8's batched decode over the same filled context give the same
    logits, and a different context gives different ones: the attention reads what was stored."""
    model = random_model(SMALL_SMOLLM2, "cpu", torch.float32)
    logits = []
    for runner in (ModelRunner(model, 256, 1, 4, 64), GraphModelRunner(model, 256, 1, 4, 64, disable_cuda_graph=True)):
        reqs = filled(runner, 2, 24)
        logits.append(runner.forward(prepare_forward(runner, reqs)))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    runner = ModelRunner(model, 256, 1, 4, 64)
    reqs = filled(runner, 2, 24)
    for layer in range(model.config.num_hidden_layers):
        runner.token_to_kv_pool.get_value_buffer(layer).zero_()
    assert not torch.allclose(runner.forward(prepare_forward(runner, reqs)), logits[0], atol=1e-3)


def test_kv_bytes_counts_every_layer_kv_head_and_both_k_and_v():
    model = random_model(SMALL_SMOLLM2, "cpu", torch.float32)  # 4 layers, 3 KV heads of 64
    per_token = 2 * 4 * 3 * 64 * 4  # K and V, layers, KV heads, dims, float32 bytes
    assert kv_bytes(model, 16, 128) == 16 * 128 * per_token
    assert kv_bytes(model.to(torch.bfloat16), 16, 128) == 16 * 128 * per_token // 2, "bfloat16 is 2 bytes a value"


def test_floor_is_the_bare_pass_plus_one_read_of_the_kv():
    model = random_model(SMALL_SMOLLM2, "cpu", torch.float32)
    rate = 10e9
    floor = memory_floor(model, 8, 256, bare_seconds=0.005, read_rate=rate)
    assert math.isclose(floor, 0.005 + kv_bytes(model, 8, 256) / rate)


def test_read_rate_is_measured_not_assumed():
    rate = memory_read_rate("cpu", megabytes=16, repeats=2)
    assert math.isfinite(rate) and 1e8 < rate < 1e13, f"{rate / 1e9:.3g} GB/s is not a memory read rate"
