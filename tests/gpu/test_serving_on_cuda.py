"""Stage 9 on CUDA: the server's scheduler process runs the newest engine (stage 11's) on the GPU in
bfloat16, with decodes replayed from CUDA graphs, and answers every request option OpenAI's API
carries there: log-probabilities (of the answer, and of an echoed prompt), penalties and
logit_bias, seeds, a JSON schema and a forced tool call (not graded; run by `make gpu-check-full`).

On a CPU machine the test is an explicit skip that says why; under ENGINE_REQUIRE_GPU=1 a missing
GPU is a failure instead.
"""

from __future__ import annotations

import json
import math

QUESTION = "What is the capital of France?"
PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
    "required": ["name", "legs"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {  # closed, so that the call ends well within max_tokens
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def check_every_option(client, model: str) -> None:
    """One request per option family, each answered as its option promises."""
    import jsonschema

    chat = [{"role": "user", "content": "Name three colours."}]
    answer = client.chat.completions.create(
        model=model,
        messages=chat,
        max_tokens=16,
        temperature=0.7,
        seed=1,
        logprobs=True,
        top_logprobs=3,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        logit_bias={"13": -100},
    )
    entries = answer.choices[0].logprobs.content
    assert entries and len(entries) == answer.usage.completion_tokens, (
        f"logprobs on CUDA: {len(entries or [])} entries for {answer.usage.completion_tokens} tokens"
    )
    for e in entries:
        values = [e.logprob] + [t.logprob for t in e.top_logprobs]
        assert len(e.top_logprobs) == 3 and all(math.isfinite(v) and v <= 0 for v in values), f"an entry: {e}"

    echoed = client.completions.create(
        model=model, prompt="The sky is", max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    scored = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("The sky is") and scored.token_logprobs[0] is None, echoed
    assert all(v is not None and math.isfinite(v) for v in scored.token_logprobs[1:]), scored.token_logprobs

    pet = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}},
    )
    jsonschema.validate(json.loads(pet.choices[0].message.content), PET)

    called = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=64,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments), call


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
        check_every_option(client, default_model_dir.name)
        state = server.debug_state()
        assert state["device"].startswith("cuda") and state["dtype"] == "torch.bfloat16", (
            f"the engine ran on {state['device']} in {state['dtype']}"
        )
        assert state["forward_paths"].get("graph", 0) > 0, f"no decode replayed a CUDA graph: {state['forward_paths']}"
        assert state["invariants"] == "ok" and state["running"] == state["waiting"] == 0, state
    finally:
        code = server.stop()
    assert code == 0, f"the server exited with code {code} on SIGTERM:\n{server.why()}"
