"""``CudaGraphRunner``: decode passes captured once per bucket at start, then replayed (SGLang's name).

A small decode batch asks the GPU for little math but still launches every kernel of every
layer from Python: hundreds of launches of a few microseconds each, and the GPU waits for them.
A CUDA graph records those launches once and replays the whole pass with one call. The price:
a graph replays exactly what it recorded, the same kernels on the same addresses with the same
shapes. So the runner keeps

    static buffers  input_ids, positions, req_pool_indices, seq_lens, out_cache_loc  [max_bs]
                    (+ the attention backend's metadata, + each graph's output logits)
    buckets         batch sizes 1 2 4 8 16 24 32 ... max_bs, times key lengths 64 128 256 ...
                    up to max_kv_len: one graph per (bs, kv_len) bucket

captures every bucket when the engine starts (largest first: the smaller graphs then reuse the
memory the largest one took; a capture that fails stops the engine right there, naming the
bucket, never in the middle of serving), and at each decode step

    1. picks the smallest bucket that holds it: 3 requests, longest context 90 -> (4, 128)
    2. copies the real batch into the first rows of the static buffers and fills the rest with
       a dummy request: table row = the reserved dummy row, out_cache_loc = the dummy slot 0,
       seq_len 1, so a padded row writes only slot 0 and reads only slot 0
    3. refills the backend's metadata for the bucket (device work, no host sync)
    4. replays the bucket's graph and returns the real rows' logits

    static input_ids  [ a  b  c  0 ]       static out_cache_loc [ 41 17 96  0 ]
    req_pool_indices  [ 2  0  5  D ]       seq_lens             [ 90 12 33  1 ]   D = dummy row

How many graphs? 11 batch sizes (max_bs 64) times 7 key lengths (64..4096) = 77. Each capture
is two warm-up passes and one recorded pass, tens of milliseconds on a GPU: seconds in all, once.
All share one memory pool (``torch.cuda.graph_pool_handle()``): their intermediate tensors are
reused between graphs, which never run at the same time. Key lengths stop at
``cuda_graph_max_kv_len`` (default 4096): a bucket's attention reads a dense [bs, kv_len] block
of keys, and at the full table width (8192 for SmolLM2, 40960 for Qwen3) the largest bucket
alone would gather gigabytes per layer. A decode with a longer sequence runs eagerly.

On a CPU there is nothing to capture: the same buckets, padding and static buffers run eagerly
through the same code, so everything but the capture itself is checked on any machine.
"""

from __future__ import annotations

import bisect
import gc
import time
from typing import TYPE_CHECKING

import torch

from s00_foundation.forward_batch import ForwardBatch, ForwardMode
from s04_paged_kv_pool.memory_pool import ReqToTokenPool

if TYPE_CHECKING:
    from .decode_attention import DecodeAttentionBackend
    from .model_runner import GraphModelRunner

DUMMY_SLOT = 0  # slot 0 (page 0) of the KV pool is never handed out (s04 memory_pool.py)
MIN_KV_LEN_BUCKET = 64
DEFAULT_CUDA_GRAPH_MAX_KV_LEN = 4096  # longer decodes run eagerly (see the docstring above)
NUM_WARMUP_RUNS = 2  # eager runs before a capture: lazy initialisation must not happen while recording


def capture_bs_buckets(max_bs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then steps of 8, and max_bs itself."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    # BEGIN EXERCISE: the batch-size buckets to capture [#what-you-write]
    buckets = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs, 8))
    return buckets + [max_bs]
    # END EXERCISE


def kv_len_buckets(max_kv_len: int) -> list[int]:
    """Key lengths graphs are captured for: 64, 128, 256, ... doubling, and max_kv_len itself."""
    if max_kv_len < 1:
        raise ValueError(f"the table width (max_context_len) must be >= 1, got {max_kv_len}")
    # BEGIN EXERCISE: the KV-length buckets to capture [#what-you-write]
    buckets, length = [], MIN_KV_LEN_BUCKET
    while length < max_kv_len:
        buckets.append(length)
        length *= 2
    return buckets + [max_kv_len]
    # END EXERCISE


def reserve_dummy_row(pool: ReqToTokenPool) -> int:
    """Add one table row past the last one the scheduler can allocate, all slots DUMMY_SLOT;
    padded requests use it. Returns its index (pool.size): alloc and free never touch it."""
    dummy = torch.full_like(pool.req_to_token[:1], DUMMY_SLOT)
    pool.req_to_token = torch.cat([pool.req_to_token, dummy])
    return pool.size


class CudaGraphRunner:
    def __init__(self, model_runner: "GraphModelRunner", max_bs: int, max_kv_len: int, dummy_req_pool_idx: int):
        """Graphs for decodes of up to ``max_bs`` requests whose longest sequence has up to
        ``max_kv_len`` tokens (capped at the table's width), all captured here."""
        self.model = model_runner.model
        self.attn_backend: DecodeAttentionBackend = model_runner.attn_backend
        self.device = model_runner.device
        self.use_cuda_graph = self.device.type == "cuda"  # elsewhere: the same path, run eagerly
        self.capture_bs = capture_bs_buckets(max_bs)
        self.max_bs = self.capture_bs[-1]
        self.capture_kv_lens = kv_len_buckets(min(max_kv_len, model_runner.req_to_token_pool.max_context_len))
        self.max_kv_len = self.capture_kv_lens[-1]
        self.dummy_req_pool_idx = dummy_req_pool_idx

        # The static input buffers: every graph reads (views of) these very tensors.
        def buffer(fill: int, dtype=torch.int64):
            return torch.full((self.max_bs,), fill, dtype=dtype, device=self.device)

        self.input_ids = buffer(0)
        self.positions = buffer(0)
        self.req_pool_indices = buffer(dummy_req_pool_idx)
        self.seq_lens = buffer(1, torch.int32)
        self.out_cache_loc = buffer(DUMMY_SLOT)
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_kv_len)

        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_cuda_graph else None
        self.batches: dict[tuple[int, int], ForwardBatch] = {}  # bucket -> its static batch
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.output_buffers: dict[tuple[int, int], torch.Tensor] = {}  # bucket -> the graph's logits
        self.capture_seconds = 0.0  # wall time of the warm-ups and captures (CUDA only)
        self.graph_memory_bytes = 0  # GPU memory the graphs took (CUDA only)
        self.capture()

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every (bs, kv_len) bucket, largest first: the order they are captured in."""
        return [(bs, kv_len) for bs in reversed(self.capture_bs) for kv_len in reversed(self.capture_kv_lens)]

    def describe(self) -> str:
        what = (
            f"{len(self.batches)} decode buckets (batch sizes {self.capture_bs[0]}..{self.max_bs} x key lengths "
            f"{self.capture_kv_lens[0]}..{self.max_kv_len})"
        )
        if not self.use_cuda_graph:
            return f"{what}, run eagerly (no CUDA here: nothing to capture)"
        return (
            f"{what} captured as CUDA graphs in {self.capture_seconds:.2f} s, "
            f"{self.graph_memory_bytes / 2**20:.0f} MiB of GPU memory"
        )

    # --- which batches, which bucket --------------------------------------------------------------

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """True for a decode batch (one new token per request) of at most max_bs requests, none
        longer than max_kv_len tokens."""
        # BEGIN EXERCISE: can a graph run this batch? [#what-you-write]
        return (
            forward_batch.forward_mode is ForwardMode.DECODE
            and forward_batch.num_reqs <= self.max_bs
            and max(forward_batch.seq_lens) <= self.max_kv_len
        )
        # END EXERCISE

    def bucket_for(self, num_reqs: int, max_seq_len: int) -> tuple[int, int]:
        """(bs, kv_len): the smallest captured batch size >= num_reqs, and the smallest key
        length >= max_seq_len. ValueError if either is beyond the largest bucket."""
        if not 1 <= num_reqs <= self.max_bs:
            raise ValueError(f"{num_reqs} requests: graph buckets hold 1..{self.max_bs} (larger decodes run eagerly)")
        if not 1 <= max_seq_len <= self.max_kv_len:
            raise ValueError(
                f"a sequence of {max_seq_len} tokens: graph buckets hold 1..{self.max_kv_len} (longer ones run eagerly)"
            )
        # BEGIN EXERCISE: the smallest bucket that holds the batch [#what-you-write]
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, num_reqs)]
        kv_len = self.capture_kv_lens[bisect.bisect_left(self.capture_kv_lens, max_seq_len)]
        return bs, kv_len
        # END EXERCISE

    # --- capture ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Set every bucket up, largest first; on CUDA capture its graph. A capture that fails
        stops here, at engine start, naming the bucket and the way to run without graphs."""
        free_before = 0
        if self.use_cuda_graph:
            # Every capture first hands the allocator's cached blocks back to the driver
            # (torch.cuda.graph runs gc.collect() and empty_cache()), so a baseline taken with a
            # cache still full of what an earlier model left would make the graphs look smaller than
            # they are, even negative (-20 MiB, seen on an H200): measure from an empty cache too.
            gc.collect()
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        for bs, kv_len in self.buckets:
            try:
                self.capture_one_batch_size(bs, kv_len)
            except NotImplementedError:  # an exercise not written yet says so itself
                raise
            except Exception as error:
                raise RuntimeError(
                    f"CUDA graph capture failed for the decode bucket (bs={bs}, kv_len={kv_len}): "
                    f"{type(error).__name__}: {error}. "
                    "Run without graphs (--disable-cuda-graph, Engine(disable_cuda_graph=True)) or with fewer buckets "
                    "(--cuda-graph-max-bs, --cuda-graph-max-kv-len)."
                ) from error
        if self.use_cuda_graph:
            torch.cuda.synchronize(self.device)
            self.capture_seconds = time.perf_counter() - start
            self.graph_memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]

    def capture_one_batch_size(self, bs: int, kv_len: int) -> None:
        """Set bucket (bs, kv_len) up: its static batch (views of the buffers, every row a dummy
        request) and the backend's metadata views; on CUDA, warm up and record its graph into the
        shared memory pool."""
        self.fill_padding(0, bs)
        batch = ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            extend_lens=[1] * bs,
            seq_lens=[1] * bs,  # true while every row is a dummy; replay_prepare sets the real ones
            attn_backend=self.attn_backend,
            req_pool_indices=self.req_pool_indices[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            forward_mode=ForwardMode.DECODE,
        )
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, kv_len, self.seq_lens[:bs])
        if self.use_cuda_graph:
            # Capture with every row a dummy request: warm-up and capture write only the dummy slot.
            self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, kv_len, self.req_pool_indices[:bs])
            # BEGIN EXERCISE: warm up, then capture one bucket's decode pass [#what-you-write]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(NUM_WARMUP_RUNS):
                    self.model(batch, return_all_logits=True)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                logits = self.model(batch, return_all_logits=True)
            self.graphs[bs, kv_len] = graph
            self.output_buffers[bs, kv_len] = logits
            # END EXERCISE
        self.batches[bs, kv_len] = batch

    # --- replay -----------------------------------------------------------------------------------

    def fill_padding(self, start: int, bs: int) -> None:
        """Rows start..bs-1 become dummy requests: token 0 at position 0 of the dummy row,
        written to the dummy slot, seeing one key (that same slot)."""
        self.input_ids[start:bs].fill_(0)
        self.positions[start:bs].fill_(0)
        self.req_pool_indices[start:bs].fill_(self.dummy_req_pool_idx)
        self.seq_lens[start:bs].fill_(1)
        self.out_cache_loc[start:bs].fill_(DUMMY_SLOT)

    def replay_prepare(self, forward_batch: ForwardBatch) -> tuple[int, int]:
        """Copy the batch into the static buffers, pad it to its bucket, refill the backend's
        metadata; returns the bucket."""
        if forward_batch.forward_mode is not ForwardMode.DECODE:
            raise ValueError(
                f"a batch in {forward_batch.forward_mode.name} mode cannot replay a decode graph (its buckets hold one "
                "new token per request): can_run is False for it, so ModelRunner.forward runs it eagerly"
            )
        n = forward_batch.num_reqs
        bucket = self.bucket_for(n, max(forward_batch.seq_lens))
        bs, kv_len = bucket
        # The static batch's host-side fields say what its rows now hold (the graph reads none of them).
        self.batches[bucket].seq_lens = list(forward_batch.seq_lens) + [1] * (bs - n)
        # BEGIN EXERCISE: copy the batch into the static buffers and pad it to its bucket [#what-you-write]
        self.input_ids[:n].copy_(forward_batch.input_ids)
        self.positions[:n].copy_(forward_batch.positions)
        self.req_pool_indices[:n].copy_(forward_batch.req_pool_indices)
        self.out_cache_loc[:n].copy_(forward_batch.out_cache_loc)
        self.seq_lens[:n].copy_(forward_batch.positions + 1)
        self.fill_padding(n, bs)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(bs, kv_len, self.req_pool_indices[:bs])
        return bucket
        # END EXERCISE

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_reqs, vocab] of the real rows: the bucket's graph replayed on CUDA, the
        same static batch run eagerly elsewhere."""
        bucket = self.replay_prepare(forward_batch)
        if self.use_cuda_graph:
            self.graphs[bucket].replay()
            logits = self.output_buffers[bucket]
        else:
            logits = self.model(self.batches[bucket], return_all_logits=True)
        # A copy: the next replay overwrites the graph's output buffer.
        return logits[: forward_batch.num_reqs].clone()
