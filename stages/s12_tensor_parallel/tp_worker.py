"""What the ranks other than rank 0 run: no scheduler, no sampler, only the forward.

Rank 0 (``TPEngine``, engine.py) schedules; every step it broadcasts the batch it built, and
every rank runs that batch through its shard of the model (SGLang's ``TpModelWorker`` on each
rank; there every rank also runs the scheduler on broadcast requests, here the followers only
mirror what rank 0's runner does)::

    rank 0                                   rank 1..N-1 (this file)
    schedule, build batch N
    broadcast BatchMessage(batch N)   ──▶    receive it, write its table rows, rebuild the ForwardBatch
    forward (all-reduces with everyone) ◀─▶  forward (all-reduces with everyone)
    gather logits, sample                    (its logits gathered on rank 0)
    ...
    broadcast None (stop)             ──▶    leave the loop, leave the group

A follower keeps no requests: the table rows a batch reads travel with it, and the tokens rank 0
sampled reach the followers as the next batch's input ids. It is started with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: ``python -m s12_tensor_parallel.tp_worker``),
by rank 0 (engine.py) or by torchrun itself.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from s00_foundation.device import set_torch_threads
from s00_foundation.forward_batch import ForwardBatch, ForwardMode

from .launch import failure_line
from .parallel_state import DEFAULT_TIMEOUT_S, TPGroup, destroy_tp_group, init_tp_group_from_env
from .weight_loader import load_tp_model


@dataclass
class BatchMessage:
    """One step's batch as rank 0 broadcasts it: plain lists, no device tensors (a few KB)."""

    input_ids: list[int]
    positions: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    req_pool_indices: list[int]
    out_cache_loc: list[int]
    forward_mode: ForwardMode
    table_rows: list[list[int]]  # req_to_token[row, :seq_len] of each request: the slots its K/V live in
    extra_logit_rows: list[int]  # prompt rows whose logits rank 0 scores: every rank joins their gather

    @classmethod
    def of(cls, batch: ForwardBatch, req_to_token: torch.Tensor) -> "BatchMessage":
        assert batch.req_pool_indices is not None and batch.out_cache_loc is not None and batch.forward_mode
        rows = batch.req_pool_indices.tolist()
        return cls(
            batch.input_ids.tolist(),
            batch.positions.tolist(),
            list(batch.extend_lens),
            list(batch.seq_lens),
            rows,
            batch.out_cache_loc.tolist(),
            batch.forward_mode,
            [req_to_token[row, :n].tolist() for row, n in zip(rows, batch.seq_lens)],
            list(batch.extra_logit_rows),
        )

    def to_forward_batch(self, runner) -> ForwardBatch:
        """The same batch on this rank: its table rows written into this rank's table (the K/V of
        a token sit in the same slot on every rank, each rank holding its own heads)."""
        raise NotImplementedError(
            "Stage 12: write the table rows, rebuild the ForwardBatch on this rank - see stages/s12_tensor_parallel/README.md#follower"  # noqa: E501 (one message, the learner's to read whole)
        )


@dataclass
class RunnerSpec:
    """What a follower needs to build the same runner as rank 0 (sent once, at start)."""

    model_path: str
    dtype: torch.dtype
    config: object  # rank 0's engine config (TPEngineConfig)
    pool_size: int
    max_context_len: int


def follower_loop(runner, tp: TPGroup) -> int:
    """Run every batch rank 0 broadcasts until it says stop; returns the number of steps run."""
    steps = 0
    while (message := tp.broadcast_object()) is not None:
        batch = message.to_forward_batch(runner)
        check_rebuilt(message, batch)
        runner.forward(batch)
        steps += 1
    return steps


def check_rebuilt(message: BatchMessage, batch: ForwardBatch) -> None:
    """Raise ValueError unless ``batch`` has the shape of rank 0's: the same tokens, requests and
    mode, the same prompt rows scored. A batch that differs would still run (the collectives
    only see tensors, and gloo gathers tensors of any size), giving rank 0 logits or sums that
    are silently wrong; here the follower stops instead, naming the field."""
    pairs = {  # field -> (what this follower rebuilt, what rank 0 sent)
        "len(input_ids)": (len(batch.input_ids), len(message.input_ids)),
        "len(positions)": (len(batch.positions), len(message.positions)),
        "extend_lens": (list(batch.extend_lens), message.extend_lens),
        "seq_lens": (list(batch.seq_lens), message.seq_lens),
        "forward_mode": (batch.forward_mode, message.forward_mode),
        "extra_logit_rows": (list(batch.extra_logit_rows), message.extra_logit_rows),
    }
    for field, (rebuilt, sent) in pairs.items():
        if rebuilt != sent:
            raise ValueError(
                f"to_forward_batch rebuilt rank 0's batch with {field} {rebuilt!r:.200}, rank 0 sent "
                f"{sent!r:.200}: a follower's batch must be the one rank 0 broadcast, field for field"
            )


def watch_parent() -> None:
    """Exit as soon as the process that started this one is gone (a killed rank 0 must not leave
    followers waiting on a group nobody will ever talk to)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def where_it_failed(error: BaseException) -> str:
    """' (at s12_tensor_parallel/layers.py:150 in VocabParallelEmbedding.forward)': the innermost
    frame of the course's own code (this package's parent folder, solutions/ or stages/), where
    the bug most likely is; '' if none (the error came from elsewhere)."""
    root = Path(__file__).resolve().parents[1]
    where = ""
    for frame, line in traceback.walk_tb(error.__traceback__):
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(root):
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # co_qualname: Python 3.11+
            where = f" (at {path.relative_to(root).as_posix()}:{line} in {name})"
    return where


def follower_main() -> int:
    from .model_runner import make_tp_runner  # it imports this module: import it when run

    rank = int(os.environ.get("RANK", "0"))
    device_type = os.environ.get("TP_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(f"cuda:{local_rank}" if device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_torch_threads()  # OMP_NUM_THREADS when set (1 per rank on a CPU), else one per physical core
    watch_parent()
    tp = init_tp_group_from_env(device, float(os.environ.get("TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    try:
        with torch.inference_mode():
            spec: RunnerSpec = tp.broadcast_object()
            model = load_tp_model(spec.model_path, tp, device, spec.dtype)
            runner = make_tp_runner(model, spec.config, spec.pool_size, spec.max_context_len, tp)
            tp.barrier()  # ready: rank 0's engine is built once every rank is
            follower_loop(runner, tp)
    except Exception as error:
        # Rank 0's watchdog reads this line as the reason the group stopped (launch.py).
        why = f"{type(error).__name__}: {error}{where_it_failed(error)}"
        print(failure_line(rank) + why, file=sys.stderr, flush=True)
        return 1
    destroy_tp_group(tp)
    return 0


if __name__ == "__main__":
    sys.exit(follower_main())
