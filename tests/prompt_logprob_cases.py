"""One batch of requests asking for their prompts' log-probabilities, for every engine from stage 4
on: prompts that share a long prefix (so a radix cache holds it when the batch runs again), one
long enough to be cut in chunks, a one-token prompt, and requests that do not ask. Each entry is
checked against transformers; run twice, the second run finds every prefix cached."""

from __future__ import annotations

from reference import assert_prompt_logprobs_match
from s02_request_and_sampling.sampling_params import SamplingParams

SHARED = [33 + (7 * i) % 90 for i in range(40)]
PROMPTS = [
    SHARED + [50, 51, 52],  # does not ask: it puts the shared prefix in the tree
    SHARED + [60, 61],
    [40 + (5 * i) % 80 for i in range(37)],
    [42],
    SHARED[:30] + [70, 71, 72, 73],
    SHARED + [80],  # does not ask
]
TOP_KS = [None, 2, 1, 0, 3, None]


def prompt_logprob_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_new_tokens=3 + i, ignore_eos=True, prompt_logprobs=k)
        for i, k in enumerate(TOP_KS)
    ]


def assert_prompt_logprobs_case(path, outputs, what: str) -> None:
    """``outputs`` (of PROMPTS under prompt_logprob_params()) score every prompt as transformers does."""
    __tracebackhide__ = True
    for i, (prompt, k, out) in enumerate(zip(PROMPTS, TOP_KS, outputs)):
        if k is None:
            assert out.prompt_logprobs is None, (
                f"{what}: request {i} did not ask for prompt_logprobs, yet got {out.prompt_logprobs!r:.80}"
            )
        else:
            assert_prompt_logprobs_match(path, prompt, out, k, f"{what}: request {i} ({len(prompt)}-token prompt)")
