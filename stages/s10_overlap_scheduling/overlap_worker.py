"""``OverlapWorker``: runs each step's forward pass and sampling away from the scheduler.

Provided plumbing (no exercise here): the ideas live in scheduler.py. The scheduler hands a built
batch to ``submit`` and goes on at once; it gets the sampled tokens from the returned future when
it processes that step. Steps run one at a time, in the order they were submitted, so step N+1's
forward always starts after step N's sampled tokens are in the future map.

- On a CPU the worker is a thread. torch releases Python's GIL inside its ops, so with torch on
  one thread the machine's two cores split into "forward" (this thread, mostly inside matmuls)
  and "scheduler" (the caller's Python): the overlap is real and measurable.
- On CUDA the thread launches the step on a stream of its own (as SGLang's forward stream does),
  after an event the scheduler recorded once the batch's inputs were queued, and waits for the
  sampled tokens' copy to the host; the scheduler's thread never blocks on the GPU.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from s00_foundation.forward_batch import ForwardBatch
from s02_request_and_sampling.logprobs import TokenLogprob, token_logprobs
from s02_request_and_sampling.req import Req
from s02_request_and_sampling.sampler import sample_with_penalties

from .future_map import FutureMap


@dataclass
class ForwardResult:
    token_ids: list[int]  # one per sampled request, in the order given to submit
    start: float  # when the worker started this step (perf_counter, seconds)
    end: float  # when its tokens were on the host
    # entry i: sampled request i's TokenLogprob, None if it did not ask (computed here, where the logits are)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)


class OverlapWorker:
    def __init__(self, runner, future_map: FutureMap):
        self.runner, self.future_map = runner, future_map
        self.device = torch.device(runner.device)
        # torch's thread count is set per thread: the worker uses the scheduler's (OMP_NUM_THREADS=1 in make).
        threads = torch.get_num_threads()
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="forward", initializer=torch.set_num_threads, initargs=(threads,)
        )
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def submit(
        self, batch: ForwardBatch, sample_rows: list[int], sample_reqs: list[Req], future_ids: list[int]
    ) -> Future:
        """Queue one step: resolve the batch's future ids, run the forward, sample the rows
        ``sample_rows`` (row i belongs to ``sample_reqs[i]``), store the tokens under
        ``future_ids``. Returns a Future of a ForwardResult."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the batch's inputs and table writes, queued on the scheduler's stream
        return self.executor.submit(self.run, batch, sample_rows, sample_reqs, future_ids, ready)

    def run_now(
        self, batch: ForwardBatch, sample_rows: list[int], sample_reqs: list[Req], future_ids: list[int]
    ) -> Future:
        """The same step run here, on the caller's thread, before returning (overlap off: no
        hand-over to the worker, so the plain loop pays nothing for the thread)."""
        done: Future = Future()
        try:
            done.set_result(self.run(batch, sample_rows, sample_reqs, future_ids, None))
        except Exception as error:  # raised where the overlapped loop would see it: at processing
            done.set_exception(error)
        return done

    def run(self, batch, sample_rows, sample_reqs, future_ids, ready) -> ForwardResult:
        start = time.perf_counter()
        with torch.inference_mode():  # a per-thread mode: the scheduler's does not reach here
            if self.stream is None or ready is None:
                tokens, logprobs = self.forward_and_sample(batch, sample_rows, sample_reqs, future_ids)
                return ForwardResult(tokens.tolist(), start, time.perf_counter(), logprobs)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                tokens, logprobs = self.forward_and_sample(batch, sample_rows, sample_reqs, future_ids)
                host = tokens.to("cpu", non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            done.synchronize()  # this thread waits for the GPU; the scheduler's does not
            return ForwardResult(host.tolist(), start, time.perf_counter(), logprobs)

    def forward_and_sample(
        self, batch, sample_rows, sample_reqs, future_ids
    ) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
        """The step's forward, its sampled tokens (stored under ``future_ids``) and their
        log-probabilities (for the requests that asked; taken from the raw logits, before
        ``sample`` and stage 11's mask)."""
        self.future_map.resolve(batch.input_ids)
        logits = self.runner.forward(batch)
        if not sample_rows:
            return torch.empty(0, dtype=torch.int64), []
        logits = logits[sample_rows]
        tokens = self.sample(logits, sample_reqs)  # (leaves ``logits`` as they are: stage 11 masks a copy)
        self.future_map.store(future_ids, tokens)
        return tokens, token_logprobs(logits, tokens, sample_reqs)

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """One token per row (stage 2's sampler, penalties included: their counts are kept here, on
        the worker, the one place that sees every token drawn); stage 11 masks the logits first,
        where the full logits are, never inside the model's forward. ``logits`` must stay as they
        are: the requests' log-probabilities are read from them afterwards."""
        return sample_with_penalties(logits, reqs)

    def wait_idle(self) -> None:
        """Block until every step submitted so far has run (whether it succeeded or not)."""
        self.executor.submit(lambda: None).result()
