"""One line per scheduler step, to watch the batch breathe.

    step   12 | prefill  2 reqs   87 tok | decode  5 | running  7 waiting  3 | free KV  120/512 |  41.2 ms
    step   13 | prefill  0 reqs    0 tok | decode  7 | running  6 waiting  3 | free KV  139/512 |  12.0 ms | finished 4
    step   14 | prefill  0 reqs    0 tok | decode  5 | running  5 waiting  4 | free KV   31/512 |  11.5 ms | retracted 9

Read a line as: this step's forward pass prefilled 2 newly admitted requests (87 prompt tokens)
and decoded one token for each of 5 running requests; after it, 7 requests run, 3 wait, and 120
of the pool's 512 KV slots are free. ``StepTrace`` holds the same facts as data (the request ids
in each role, the step's start and end time), which is what the notebook draws its timeline from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class StepTrace:
    step: int  # 1, 2, ... (counted since the scheduler was made)
    start: float  # clock at the start of the step (seconds)
    end: float  # clock when its tokens were sampled and its finished requests retired
    prefill_rids: list[Hashable]  # requests prefilled by this step's pass, in batch order
    prefill_tokens: int  # tokens those prefills computed
    decode_rids: list[Hashable]  # requests that decoded one token in this pass
    running: int  # requests running after the step
    waiting: int  # requests waiting after the step
    free_slots: int  # free KV slots after the step (finished requests already freed)
    pool_size: int
    retracted_rids: list[Hashable] = field(default_factory=list)  # sent back to the waiting queue first
    finished_rids: list[Hashable] = field(default_factory=list)  # finished by this step

    def line(self) -> str:
        text = (
            f"step {self.step:4d} | prefill {len(self.prefill_rids):2d} reqs {self.prefill_tokens:5d} tok | "
            f"decode {len(self.decode_rids):3d} | running {self.running:3d} waiting {self.waiting:3d} | "
            f"free KV {self.free_slots:5d}/{self.pool_size} | {1000 * (self.end - self.start):6.1f} ms"
        )
        if self.retracted_rids:
            text += f" | retracted {' '.join(map(str, self.retracted_rids))}"
        if self.finished_rids:
            text += f" | finished {' '.join(map(str, self.finished_rids))}"
        return text


def print_trace(trace: StepTrace) -> None:
    print(trace.line(), flush=True)
