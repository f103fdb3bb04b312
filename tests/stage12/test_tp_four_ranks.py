"""Stage 12 (graded): 4 ranks on a model with 4 query heads and 2 KV heads (each KV head
replicated on two ranks) give one device's greedy tokens."""

from __future__ import annotations

from tp_helpers import KNOBS, PROMPTS, greedy, pid_running, reference_outputs

from s12_tensor_parallel.engine import TPEngine


def test_four_ranks_with_replicated_kv_heads_give_one_devices_tokens(tiny_models_root):
    path = tiny_models_root / "qwen3"
    expected = reference_outputs(path, greedy(6))
    engine = TPEngine(str(path), tp_size=4, tp_timeout_s=30, **KNOBS)
    pids = engine.launcher.pids
    try:
        got = [out.output_ids for out in engine.generate(PROMPTS, greedy(6))]
    finally:
        engine.shutdown()
    assert got == expected, f"qwen3, tp=4 (KV heads replicated): greedy tokens {got}, one device {expected}"
    assert not [pid for pid in pids if pid_running(pid)], "shutdown left rank processes running"
