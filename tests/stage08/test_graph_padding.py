"""Stage 8 (graded): padding to the bucket, static buffers, and the dummy slot.

A batch of 3 decodes runs as 4 rows: the 4th is a dummy request whose table row is the reserved
dummy row and whose K/V go to the reserved dummy slot, so a padded pass never writes another
request's K/V and leaves every slot but the real rows' new ones untouched."""

from __future__ import annotations

import pytest

from graph_helpers import pool_bytes, prompts_of, run_pass, runners, start
from reference import engine_model
from s08_cuda_graph.cuda_graph_runner import DUMMY_SLOT


def test_a_batch_of_3_is_padded_to_4_with_dummy_requests(tiny_models_root):
    runner, _ = runners(engine_model(str(tiny_models_root / "qwen3")))
    graph = runner.cuda_graph_runner
    dummy_row = runner.req_to_token_pool.size
    six = start(runner, prompts_of(6))
    run_pass(runner, six)  # prefill
    run_pass(runner, six)  # a decode of 6: bucket 8, the static rows 0..5 hold real requests
    three = six[:3]
    batch, _ = run_pass(runner, three)  # bucket 4: rows 3.. once held requests 3..5, now padding
    assert runner.last_forward_path == "graph", (
        f"a decode of 3 requests should take the graph path, took {runner.last_forward_path!r}"
    )
    rows = graph.req_pool_indices[:4].tolist()
    assert rows[:3] == batch.req_pool_indices.tolist(), f"static req_pool_indices: the real rows come first, got {rows}"
    assert rows[3] == dummy_row, (
        f"row 3 pads the batch: its table row must be the reserved dummy row {dummy_row}, got {rows[3]}"
    )
    slots = graph.out_cache_loc[:4].tolist()
    assert slots[:3] == batch.out_cache_loc.tolist(), (
        f"static out_cache_loc: the real rows' new slots come first, got {slots}"
    )
    assert slots[3] == DUMMY_SLOT, (
        f"row 3 pads the batch: it must write its K/V to the dummy slot {DUMMY_SLOT}, got slot {slots[3]}"
    )
    seq_lens = graph.seq_lens[:4].tolist()
    assert seq_lens == [r.device_len - 1 for r in three] + [1], (
        f"static seq_lens: the real requests' lengths, then 1 for the padding row; got {seq_lens}"
    )
    static = graph.batches[graph.bucket_for(3, max(batch.seq_lens))]
    assert static.seq_lens == batch.seq_lens + [1], (
        "the bucket's static batch says what its rows hold (the real lengths, then 1 for the padding): "
        f"{static.seq_lens}"
    )
    assert (runner.req_to_token_pool.req_to_token[dummy_row] == DUMMY_SLOT).all(), (
        "the dummy table row must hold only the dummy slot"
    )
    assert dummy_row not in runner.req_to_token_pool.free_slots, "the dummy row must never be handed to a request"
    meta = runner.attn_backend.decode_metadata
    assert meta.kv_indices.shape[0] == 4 and (meta.kv_indices[3] == DUMMY_SLOT).all(), (
        "the attention metadata of the padding row must point only at the dummy slot"
    )
    assert meta.key_mask[3].tolist().count(True) == 1, "the padding row sees exactly one key (the dummy slot)"


def test_static_buffers_are_reused_across_steps(tiny_models_root):
    runner, _ = runners(engine_model(str(tiny_models_root / "llama")))
    graph = runner.cuda_graph_runner
    names = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
    buffers = {name: getattr(graph, name) for name in names}
    addresses = {name: t.data_ptr() for name, t in buffers.items()}
    reqs = start(runner, prompts_of(5))
    run_pass(runner, reqs)
    for step in range(4):
        run_pass(runner, reqs[: 5 - step])  # 5, 4, 3, 2 requests: buckets 8, 4, 4, 2
        assert runner.last_forward_path == "graph", (
            f"decode step {step}: expected the graph path, got {runner.last_forward_path!r}"
        )
        for name in names:
            now = getattr(graph, name)
            assert now is buffers[name] and now.data_ptr() == addresses[name], (
                f"decode step {step}: static buffer {name} was replaced by a new tensor; a captured graph reads the "
                "old addresses, so copy the batch into the buffer (copy_) instead"
            )
        meta, backend = runner.attn_backend.decode_metadata, runner.attn_backend
        for name, buffer in (("kv_indices", backend.cuda_graph_kv_indices), ("key_mask", backend.cuda_graph_key_mask)):
            assert getattr(meta, name).data_ptr() == buffer.data_ptr(), (
                f"decode step {step}: the bucket's decode metadata {name} is no longer a view of the graph's buffer: "
                f"fill_decode_metadata must write into meta.{name} in place (copy_), not assign a new tensor; a "
                "captured graph reads the buffer it was recorded with"
            )
    for (bs, kv_len), batch in graph.batches.items():
        for name in ("input_ids", "positions", "req_pool_indices", "out_cache_loc"):
            view = getattr(batch, name)
            assert view.data_ptr() == buffers[name].data_ptr() and len(view) == bs, (
                f"bucket ({bs}, {kv_len}): its batch's {name} must be the first {bs} rows of the static buffer"
            )


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_padded_pass_writes_only_the_real_rows_new_slots(tiny_models_root, page_size):
    runner, _ = runners(engine_model(str(tiny_models_root / "qwen2")), page_size=page_size)
    reqs = start(runner, prompts_of(7))
    run_pass(runner, reqs)  # prefill
    run_pass(runner, reqs)  # decode of 7 (bucket 8)
    run_pass(runner, reqs[:5])  # decode of 5 (bucket 8): rows 5..7 are padding
    before = pool_bytes(runner)
    batch, _ = run_pass(runner, reqs[:3])  # decode of 3: bucket 4, one padding row
    assert runner.last_forward_path == "graph"
    after = pool_bytes(runner)
    page = runner.token_to_kv_pool.page_size
    changed = (after != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    allowed = set(batch.out_cache_loc.tolist()) | set(range(page))  # the real rows' new slots, the dummy page
    stray = [slot for slot in changed if slot not in allowed]
    assert not stray, (
        f"page_size {page_size}: a padded decode of 3 requests (new slots {batch.out_cache_loc.tolist()}) changed "
        f"the K/V of slot(s) {stray[:8]}: "
        "padding rows must write only the dummy slot"
    )
    for slot in batch.out_cache_loc.tolist():
        assert slot in changed, f"the real request's new slot {slot} was not written"
