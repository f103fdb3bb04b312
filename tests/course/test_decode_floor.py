"""The decode benchmark's floor (s08 decode_latency.py; provided code, not graded): the K/V bytes a
decode step must read, the device's read rate, and the floor they give with the bare pass."""

from __future__ import annotations

import math

import torch

from s08_cuda_graph.decode_latency import SMALL_SMOLLM2, kv_bytes, memory_floor, memory_read_rate, random_model


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
