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
from s02_request_and_sampling.prompt_logprobs import PromptLogprobRows, read_prompt_rows
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
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the step's prompt_rows' entries, in order


@dataclass
class Step:
    """One step as the scheduler hands it over: the batch, and what to do with its logits."""

    batch: ForwardBatch
    sample_rows: list[int]  # the rows sampled (a half-prefilled request's row is not)
    sample_reqs: list[Req]  # sample_rows[i] belongs to sample_reqs[i]
    future_ids: list[int]  # where each sampled token is stored for the next step to read
    prompt_rows: PromptLogprobRows  # the prompt positions it scores (prompt_logprobs)


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

    def submit(self, step: Step) -> Future:
        """Queue one step: resolve the batch's future ids, run the forward, score its prompt rows,
        sample the rows ``sample_rows`` (row i belongs to ``sample_reqs[i]``), store the tokens
        under ``future_ids``. Returns a Future of a ForwardResult."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the batch's inputs and table writes, queued on the scheduler's stream
        return self.executor.submit(self.run, step, ready)

    def run_now(self, step: Step) -> Future:
        """The same step run here, on the caller's thread, before returning (overlap off: no
        hand-over to the worker, so the plain loop pays nothing for the thread)."""
        done: Future = Future()
        try:
            done.set_result(self.run(step, None))
        except Exception as error:  # raised where the overlapped loop would see it: at processing
            done.set_exception(error)
        return done

    def run(self, step: Step, ready) -> ForwardResult:
        start = time.perf_counter()
        with torch.inference_mode():  # a per-thread mode: the scheduler's does not reach here
            if self.stream is None or ready is None:
                tokens, logprobs, prompt = self.forward_and_sample(step)
                return ForwardResult(tokens.tolist(), start, time.perf_counter(), logprobs, prompt)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                tokens, logprobs, prompt = self.forward_and_sample(step)
                host = tokens.to("cpu", non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            done.synchronize()  # this thread waits for the GPU; the scheduler's does not
            return ForwardResult(host.tolist(), start, time.perf_counter(), logprobs, prompt)

    def forward_and_sample(self, step: Step) -> tuple[torch.Tensor, list[TokenLogprob | None], list[TokenLogprob]]:
        """The step's forward, its sampled tokens (stored under ``future_ids``), their
        log-probabilities (for the requests that asked; taken from the raw logits, before
        ``sample`` and stage 11's mask) and its prompt rows' entries."""
        self.future_map.resolve(step.batch.input_ids)
        logits, prompt = read_prompt_rows(step.prompt_rows, self.runner.forward(step.batch))
        if not step.sample_rows:
            return torch.empty(0, dtype=torch.int64), [], prompt
        logits = logits[step.sample_rows]
        tokens = self.sample(logits, step.sample_reqs)  # (leaves ``logits`` as they are: stage 11 masks a copy)
        self.future_map.store(step.future_ids, tokens)
        return tokens, token_logprobs(logits, tokens, step.sample_reqs), prompt

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """One token per row (stage 2's sampler, penalties included: their counts are kept here, on
        the worker, the one place that sees every token drawn); stage 11 masks the logits first,
        where the full logits are, never inside the model's forward. ``logits`` must stay as they
        are: the requests' log-probabilities are read from them afterwards."""
        return sample_with_penalties(logits, reqs)

    def wait_idle(self) -> None:
        """Block until every step submitted so far has run (whether it succeeded or not)."""
        self.executor.submit(lambda: None).result()
