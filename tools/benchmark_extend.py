"""Extend (prefill) attention of one layer on a CPU: stage 8's fused kernel (extend_kernel.cpp)
against stage 4's path (gather the request's K/V with ``index_select``, one SDPA per request),
for chunks of new tokens after cached prefixes, side by side.

Each point is one request whose prefix and new tokens sit in scattered pool slots, as a chunked
prefill leaves them; the time is the median of ``--repeats`` calls of the backend's ``forward``
(the new K/V written, then attention), and GFLOP/s counts the causal attention's useful products
(4 x head_dim FLOPs, i.e. 2 x head_dim multiply-adds for the scores and the weighted values, per
query-key pair that the mask lets through). Nothing is asserted.

    python tools/benchmark_extend.py                                 # SmolLM2-135M's heads
    python tools/benchmark_extend.py --heads 16,8,128                # Qwen3-0.6B's
    python tools/benchmark_extend.py --chunks 512 --prefixes 0,512,1024,2048 --threads 2
    python tools/benchmark_extend.py --dtype bfloat16                # a bfloat16 pool, q, k and v
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import impl_switch  # noqa: E402

SWITCH = impl_switch.install()

import torch  # noqa: E402

from s00_foundation.device import describe, set_torch_threads  # noqa: E402
from s00_foundation.forward_batch import ForwardBatch  # noqa: E402
from s04_paged_kv_pool.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from s04_paged_kv_pool.paged_backend import PagedAttentionBackend  # noqa: E402
from s08_cuda_graph import decode_kernel  # noqa: E402
from s08_cuda_graph.decode_attention import DecodeAttentionBackend  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def median_ms(backend, batch, qkv, repeats: int) -> float:
    backend.init_forward_metadata(batch)
    backend.forward(*qkv, 0, batch)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.init_forward_metadata(batch)
        backend.forward(*qkv, 0, batch)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def point(
    heads: int, kv_heads: int, head_dim: int, prefix: int, chunk: int, repeats: int, dtype: torch.dtype
) -> tuple[float, float]:
    """(fused ms, stage 4 ms) for one request of ``chunk`` new tokens after ``prefix`` cached ones."""
    g = torch.Generator().manual_seed(0)
    n = prefix + chunk
    kv = TokenToKVPool(2 * n, 1, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    for buffer in (kv.k_buffer[0], kv.v_buffer[0]):
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    table = ReqToTokenPool(1, n)
    table.req_to_token[0] = torch.randperm(2 * n, generator=g)[:n] + 1  # scattered, never the dummy slot 0
    batch = ForwardBatch.build(
        [[1] * chunk], [prefix], None, req_pool_indices=[0], out_cache_loc=table.req_to_token[0, prefix:].clone()
    )
    qkv = (
        torch.randn(chunk, heads, head_dim, generator=g).to(dtype),
        torch.randn(chunk, kv_heads, head_dim, generator=g).to(dtype),
        torch.randn(chunk, kv_heads, head_dim, generator=g).to(dtype),
    )
    fused = DecodeAttentionBackend(table, kv)
    if decode_kernel.load().extend_op is None:
        raise SystemExit(f"the fused extend kernel is not available here: {fused.extend_path_reason}")
    fused.extend_path = "fused"  # measured even where the engine would choose SDPA (a bfloat16 pool on AMX)
    return median_ms(fused, batch, qkv, repeats), median_ms(PagedAttentionBackend(table, kv), batch, qkv, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size (default: SmolLM2-135M)")
    parser.add_argument("--chunks", default="128,512", help="new tokens per call")
    parser.add_argument("--prefixes", default="0,512,1024", help="cached tokens before them")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per point (the median is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: one per physical core)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the pool's and q/k/v's")
    args = parser.parse_args()
    heads, kv_heads, head_dim = ints(args.heads)
    set_torch_threads(args.threads)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{describe('cpu')}, torch {torch.__version__}, load average {load}")
    dtype = getattr(torch, args.dtype)
    print(
        f"{heads} query heads over {kv_heads} KV heads of {head_dim}, {args.dtype}, one layer, median of {args.repeats}"
    )
    print(
        f"{'prefix':>7} {'chunk':>6} {'fused':>10} {'stage 4':>10} {'fused GF/s':>11} {'stage 4 GF/s':>13} {'ratio':>6}"
    )
    for chunk in ints(args.chunks):
        for prefix in ints(args.prefixes):
            fused, paged = point(heads, kv_heads, head_dim, prefix, chunk, args.repeats, dtype)
            flops = 4 * head_dim * heads * (chunk * prefix + chunk * (chunk + 1) / 2)
            print(
                f"{prefix:7d} {chunk:6d} {fused:8.2f} ms {paged:7.2f} ms {flops / fused / 1e6:11.0f} "
                f"{flops / paged / 1e6:13.0f} {paged / fused:5.2f}x"
            )


if __name__ == "__main__":
    main()
