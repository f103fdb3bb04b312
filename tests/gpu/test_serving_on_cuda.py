"""Stage 9 on CUDA: the server's scheduler process runs stage 8's engine on the GPU in bfloat16, with
decodes replayed from CUDA graphs (not graded; run by `make gpu-check-full`).

On a CPU machine the test is an explicit skip that says why; under ENGINE_REQUIRE_GPU=1 a missing
GPU is a failure instead.
"""

from __future__ import annotations

QUESTION = "What is the capital of France?"


def test_the_server_answers_on_cuda_with_graphs(cuda_device, default_model_dir, tmp_path):
    from openai import OpenAI

    from stage09.serving_helpers import Server, stream_concurrently

    server = Server(default_model_dir, ["--device", "cuda", "--pool-size", "8192"], tmp_path)
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
        answer = client.chat.completions.create(
            model=default_model_dir.name, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
        )
        assert "Paris" in answer.choices[0].message.content, (
            f"on CUDA the server answered {answer.choices[0].message.content!r}"
        )

        requests_ = [
            dict(
                model=default_model_dir.name,
                messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                max_tokens=24,
                temperature=0,
            )
            for i in range(12)
        ]
        for i, (text, finish) in enumerate(stream_concurrently(server, "chat", requests_)):
            assert text and finish in ("stop", "length"), f"stream {i} on CUDA ended with {finish!r} after {text!r}"
        state = server.debug_state()
        assert state["device"].startswith("cuda") and state["dtype"] == "torch.bfloat16", (
            f"the engine ran on {state['device']} in {state['dtype']}"
        )
        assert state["forward_paths"].get("graph", 0) > 0, f"no decode replayed a CUDA graph: {state['forward_paths']}"
        assert state["invariants"] == "ok" and state["running"] == state["waiting"] == 0, state
    finally:
        code = server.stop()
    assert code == 0, f"the server exited with code {code} on SIGTERM:\n{server.why()}"
