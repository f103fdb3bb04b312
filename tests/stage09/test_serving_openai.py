"""Stage 9 (graded): the official ``openai`` client, streaming and not, gets exactly the text the
offline engine produces for the same request (finish reasons and token counts included), and 40
concurrent streaming clients all get theirs."""

from __future__ import annotations

import re

import pytest
from openai import OpenAI

from reference import engine_tokenizer, hf_prompt_logprobs
from s02_request_and_sampling.sampling_params import SamplingParams
from serving_helpers import (
    check_stream_shape,
    greedy,
    offline_engine,
    offline_outputs,
    post,
    read_sse,
    stream_concurrently,
)
from soak_serving import token_bytes

COMPLETION_PROMPTS = ["Hello", "héllo wörld ☃ 中文", "The quick brown fox jumps", "a\nb\n\nc"]


def client_for(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def run(client: OpenAI, kind: str, stream: bool, **request):
    """(text, finish_reason, usage) of one request through the openai client."""
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    if not stream:
        answer = create(**request)
        choice = answer.choices[0]
        return (choice.message.content if kind == "chat" else choice.text), choice.finish_reason, answer.usage
    pieces, finish, usage = [], None, None
    for chunk in create(stream=True, stream_options={"include_usage": True}, **request):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            pieces.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


def assert_same_answer(got, expected, what: str) -> None:
    text, finish, usage = got
    assert text == expected.text, (
        f"{what}: the server answered {text!r}, the offline engine's text is {expected.text!r}"
    )
    assert finish == expected.finish_reason.type, (
        f"{what}: finish_reason {finish!r}, but the offline engine's request ended with {expected.finish_reason}"
    )
    assert usage is not None, f"{what}: the answer has no usage (streamed: it needs the include_usage chunk)"
    counts = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    right = (expected.prompt_tokens, expected.output_tokens, expected.prompt_tokens + expected.output_tokens)
    assert counts == right, f"{what}: usage (prompt, completion, total) = {counts}, the true counts are {right}"


def stop_string_from(text: str) -> str | None:
    """Two characters from the middle of ``text`` (no U+FFFD), to use as a stop string that will match."""
    for i in range(3, len(text) - 1):
        if "\ufffd" not in text[i : i + 2]:
            return text[i : i + 2]
    return None


def test_models_lists_the_served_model(tiny_server):
    client = client_for(tiny_server)
    names = [m.id for m in client.models.list()]
    assert names == [tiny_server.model.name], (
        f"GET /v1/models should list the one served model {tiny_server.model.name!r}; got {names}"
    )
    # the listed name is usable (and the server is alive enough to answer)
    assert (
        run(client, "completion", False, model=names[0], prompt="Hi", max_tokens=2, temperature=0)[2].completion_tokens
        == 2
    )


def test_completions_equal_the_offline_engine(tiny_server):
    """Greedy completions on the tiny model (random bytes: broken UTF-8 included), with and without
    stop strings, streamed and not."""
    client, path = client_for(tiny_server), tiny_server.model
    engine, tokenizer = offline_engine(path, pool_size=4096), engine_tokenizer(str(path))
    plain = offline_outputs(engine, [tokenizer.encode(p) for p in COMPLETION_PROMPTS], greedy(12))
    with_stop = 0
    for prompt, expected in zip(COMPLETION_PROMPTS, plain):
        cases = [(None, expected)]
        stop = stop_string_from(expected.text)
        if stop is not None:
            [stopped] = offline_outputs(engine, [tokenizer.encode(prompt)], greedy(12, stop=[stop]))
            cases.append((stop, stopped))
            with_stop += stopped.finish_reason.matched == stop
        for stop, reference in cases:
            for stream in (False, True):
                what = f"completion of {prompt!r} (greedy, max_tokens 12, stop {stop!r}, stream={stream})"
                got = run(
                    client,
                    "completion",
                    stream,
                    model=path.name,
                    prompt=prompt,
                    max_tokens=12,
                    temperature=0,
                    **({"stop": stop} if stop else {}),
                )
                assert_same_answer(got, reference, what)
    assert with_stop >= 2, "the test should have exercised stop strings on at least two prompts"


def test_token_id_prompts_and_ignore_eos(tiny_server):
    client, path = client_for(tiny_server), tiny_server.model
    engine = offline_engine(path, pool_size=4096)
    ids = [72, 105, 32, 226, 152]  # ends inside a character
    [expected] = offline_outputs(engine, [ids], greedy(10, ignore_eos=True))
    for stream in (False, True):
        got = run(
            client,
            "completion",
            stream,
            model=path.name,
            prompt=ids,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert_same_answer(got, expected, f"a prompt of token ids {ids}, ignore_eos, stream={stream}")


def test_sampled_requests_with_a_seed_equal_the_offline_engine(tiny_server):
    client, path = client_for(tiny_server), tiny_server.model
    engine = offline_engine(path, pool_size=4096)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about ünïcode."}]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.02, seed=1234, max_new_tokens=16)
    [expected] = offline_outputs(engine, [messages], params)
    for stream in (False, True):
        got = run(
            client,
            "chat",
            stream,
            model=path.name,
            messages=messages,
            max_tokens=16,
            temperature=0.9,
            top_p=0.95,
            seed=1234,
            extra_body={"top_k": 50, "min_p": 0.02},
        )
        assert_same_answer(
            got,
            expected,
            f"a sampled chat (temperature 0.9, top_p 0.95, top_k 50, min_p 0.02, seed 1234), stream={stream}",
        )


def test_penalties_and_logit_bias_reach_the_sampler(tiny_server):
    """presence / frequency penalties and logit_bias (OpenAI's fields) and repetition_penalty (an
    extension) give the offline engine's answer, streamed and not; a +100 bias on one token makes
    a greedy answer of nothing else."""
    client, path = client_for(tiny_server), tiny_server.model
    engine = offline_engine(path, pool_size=4096)
    messages = [{"role": "user", "content": "Tell me a story, a story, a story."}]
    params = SamplingParams(
        temperature=0.8,
        seed=77,
        max_new_tokens=16,
        presence_penalty=0.7,
        frequency_penalty=1.3,
        repetition_penalty=1.2,
        logit_bias={101: -100, 116: 4.5},
    )
    [expected] = offline_outputs(engine, [messages], params)
    request = dict(
        model=path.name,
        messages=messages,
        max_tokens=16,
        temperature=0.8,
        seed=77,
        presence_penalty=0.7,
        frequency_penalty=1.3,
        logit_bias={"101": -100, "116": 4.5},
        extra_body={"repetition_penalty": 1.2},
    )
    for stream in (False, True):
        assert_same_answer(run(client, "chat", stream, **request), expected, f"a penalised chat, stream={stream}")
    text, _, _ = run(
        client,
        "completion",
        False,
        model=path.name,
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        logit_bias={"65": 100},
        extra_body={"ignore_eos": True},
    )
    assert text == "A" * 6, f"logit_bias {{65 ('A'): +100}} on a greedy completion should give 'AAAAAA', got {text!r}"


def test_min_tokens_holds_back_the_end(tiny_server):
    """min_tokens (vLLM's and SGLang's extension, stage 2's min_new_tokens): with +100 on EOS a greedy
    completion ends at its first token; with min_tokens=5 it goes on for 5 tokens first, as the
    offline engine does, streamed and not."""
    client, path = client_for(tiny_server), tiny_server.model
    engine = offline_engine(path, pool_size=4096)
    eos = min(engine.tokenizer.eos_token_ids)
    request = dict(model=path.name, prompt="Hello", max_tokens=12, temperature=0, logit_bias={str(eos): 100})
    _, _, usage = run(client, "completion", False, **request)
    assert usage.completion_tokens == 1, f"+100 on EOS ({eos}): a greedy completion ends at once, got {usage}"
    prompt = engine.tokenizer.encode("Hello")  # a completion's prompt is raw text: no chat template
    [expected] = offline_outputs(engine, [prompt], greedy(12, logit_bias={eos: 100.0}, min_new_tokens=5))
    assert expected.output_tokens == 6 and expected.finish_reason.type == "stop", (
        f"the offline engine: 5 tokens, then EOS; got {expected.output_ids} ({expected.finish_reason})"
    )
    for stream in (False, True):
        got = run(client, "completion", stream, **request, extra_body={"min_tokens": 5})
        assert_same_answer(got, expected, f"a completion with +100 on EOS and min_tokens=5, stream={stream}")


def test_chat_on_the_default_model_equals_the_offline_engine(default_server):
    client, path = client_for(default_server), default_server.model
    engine = offline_engine(path, pool_size=2048)
    conversations = [
        [{"role": "user", "content": "What is 2 + 2? Answer with just the number."}],
        [
            {"role": "system", "content": "You are a poet."},
            {"role": "user", "content": "Write two lines about the sea."},
        ],
    ]
    expected = offline_outputs(engine, conversations, greedy(24))
    assert {out.finish_reason.type for out in expected} == {"stop", "length"}, (
        "the workload should end once on EOS and once on max_tokens; the offline engine gave "
        f"{[str(o.finish_reason) for o in expected]}"
    )
    words = expected[1].text.split()
    stop = " " + words[len(words) // 2]
    [stopped] = offline_outputs(engine, [conversations[1]], greedy(24, stop=[stop, "zzz"]))
    for stream in (False, True):
        for messages, reference in zip(conversations, expected):
            got = run(client, "chat", stream, model=path.name, messages=messages, max_tokens=24, temperature=0)
            assert_same_answer(
                got, reference, f"chat {messages[-1]['content']!r} (greedy, max_tokens 24, stream={stream})"
            )
        got = run(
            client,
            "chat",
            stream,
            model=path.name,
            messages=conversations[1],
            max_tokens=24,
            temperature=0,
            stop=[stop, "zzz"],
        )
        assert_same_answer(got, stopped, f"chat with stop strings {[stop, 'zzz']!r} (stream={stream})")


def test_40_concurrent_streaming_clients(tiny_server):
    client, path = tiny_server, tiny_server.model
    engine, tokenizer = offline_engine(path, pool_size=4096), engine_tokenizer(str(path))
    prompts = [f"client {i}: " + "abcdefgh"[: i % 8] + "é" * (i % 3) for i in range(40)]
    limits = [4 + i % 13 for i in range(40)]
    expected = offline_outputs(engine, [tokenizer.encode(p) for p in prompts], [greedy(n) for n in limits])

    requests_ = [dict(model=path.name, prompt=p, max_tokens=n, temperature=0) for p, n in zip(prompts, limits)]
    answers = stream_concurrently(client, "completions", requests_)
    for i, ((text, finish), reference) in enumerate(zip(answers, expected)):
        what = f"concurrent client {i} of 40 (prompt {prompts[i]!r}, max_tokens {limits[i]})"
        assert (text, finish) == (reference.text, reference.finish_reason.type), (
            f"{what}: got {text!r} ({finish}), the offline engine gives {reference.text!r} "
            f"({reference.finish_reason.type})"
        )
    state = tiny_server.debug_state()
    assert state["invariants"] == "ok", (
        f"after 40 concurrent requests the scheduler's checks fail: {state['invariants']}"
    )
    assert state["running"] == state["waiting"] == 0, f"after every answer arrived, requests still run or wait: {state}"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_stream_has_a_usage_chunk_only_when_asked(tiny_server, kind):
    """Read off the wire (the openai client would hide an extra chunk): the usage-only chunk comes
    with stream_options.include_usage true, last, and never otherwise."""
    path, prompt = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        if kind == "chat"
        else ("/v1/completions", {"prompt": "Hi"})
    )
    base = {"model": tiny_server.model.name, "max_tokens": 5, "temperature": 0, "stream": True, **prompt}
    for options in (None, {"include_usage": False}, {"include_usage": True}):
        body = {**base, **({} if options is None else {"stream_options": options})}
        answer = post(tiny_server, path, body)
        assert answer.status_code == 200, f"a streamed {kind} got {answer.status_code}: {answer.text[:300]}"
        check_stream_shape(read_sse(answer), kind, body, f"a streamed {kind} with stream_options={options}")


def logprob_rows(client: OpenAI, kind: str, stream: bool, **request) -> tuple[str, list[tuple]]:
    """(text, [(token bytes, logprob, [(alternative bytes, logprob)], text_offset or None)]) of one
    request with log-probabilities, through the openai client; streamed, every chunk's entries in order."""
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    answers = list(create(stream=True, **request)) if stream else [create(**request)]
    text, rows = "", []
    for answer in answers:
        for choice in answer.choices:
            if kind == "chat":
                text += (choice.delta.content or "") if stream else choice.message.content
            else:
                text += choice.text
            shown = choice.logprobs
            if kind == "chat":
                for e in (shown.content or []) if shown is not None else []:
                    alternatives = [(bytes(a.bytes), a.logprob) for a in e.top_logprobs]
                    rows.append((bytes(e.bytes), e.logprob, alternatives, None))
            elif shown is not None:
                for token, value, top, offset in zip(
                    shown.tokens, shown.token_logprobs, shown.top_logprobs, shown.text_offset
                ):
                    alternatives = None if top is None else [(token_bytes(t), v) for t, v in top.items()]
                    rows.append((token_bytes(token), value, alternatives, offset))
    return text, rows


def test_logprobs_equal_the_offline_engines(tiny_server):
    """logprobs through both APIs, streamed and not: one entry per generated token (a matched EOS's
    with no text), each the offline engine's logprob and alternatives, the tokens' bytes joined are
    the text, and a completion's text_offsets say where each token starts."""
    client, path = client_for(tiny_server), tiny_server.model
    engine, tokenizer = offline_engine(path, pool_size=4096), engine_tokenizer(str(path))
    messages = [{"role": "user", "content": "Say ünïcode"}]
    cases = [
        ("chat", messages, greedy(10, logprobs=2), dict(messages=messages, logprobs=True, top_logprobs=2)),
        (
            "completion",
            tokenizer.encode("héllo"),
            greedy(10, logprobs=3, ignore_eos=True),
            dict(prompt="héllo", logprobs=3, extra_body={"ignore_eos": True}),
        ),
    ]
    for kind, prompt, params, request in cases:
        [expected] = offline_outputs(engine, [prompt], params)
        shown = expected.logprobs  # one entry per generated token (a matched EOS's with no text)
        ended_by_token = isinstance(expected.finish_reason.matched, int)
        for stream in (False, True):
            what = f"a {kind} with logprobs (stream={stream})"
            text, rows = logprob_rows(client, kind, stream, model=path.name, max_tokens=10, temperature=0, **request)
            assert text == expected.text, (
                f"{what}: the text {text!r} differs from the offline engine's {expected.text!r}"
            )
            assert rows, (
                f"{what}: the answer carries no log-probabilities; the request's logprobs fields must reach the "
                "engine as SamplingParams.logprobs (to_sampling_params)"
            )
            assert len(rows) == len(shown), (
                f"{what}: {len(rows)} entries, but {len(shown)} tokens were generated (finish "
                f"{expected.finish_reason}: a matched EOS has its entry too, with no text)"
            )
            for i, ((data, value, alternatives, _), entry) in enumerate(zip(rows, shown)):
                token_ids = [entry.token_id, *(t for t, _ in entry.top)]
                (_, want), *tops = tokenizer.token_pieces(token_ids)
                if entry.token_id in tokenizer.control_ids or (ended_by_token and i == len(shown) - 1):
                    want = b""  # (the text leaves it out)
                assert data == want and abs(value - entry.logprob) < 1e-4, (
                    f"{what}: entry {i} is {data!r} with {value:.6f}; the offline engine's token {entry.token_id} "
                    f"is {want!r} with {entry.logprob:.6f}"
                )
                assert [a for a, _ in alternatives] == [b for _, b in tops], (
                    f"{what}: entry {i}'s alternatives are {alternatives}, the offline engine's are {tops}"
                )
            assert b"".join(row[0] for row in rows).decode("utf-8", "replace") == text, (
                f"{what}: the entries' bytes joined should spell the text {text!r}"
            )
            if kind == "completion":
                offsets = [row[3] for row in rows]
                starts = [len(b"".join(row[0] for row in rows[:i]).decode("utf-8", "ignore")) for i in range(len(rows))]
                assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text), (
                    f"{what}: text_offset is where each token's text starts: got {offsets} for {text!r} ({starts})"
                )


def test_echo_starts_the_answer_with_the_prompt_and_its_logprobs(tiny_server):
    """A completion with echo: the text is the prompt as the model read it, then the answer; with
    logprobs, one entry per prompt token first (the first null: nothing precedes it), each the
    offline engine's prompt_logprobs, then the answer's entries, their bytes joined the text and
    text_offset counted from the prompt's start. Streamed or not, a text or a token-id prompt,
    every choice of n."""
    client, path = client_for(tiny_server), tiny_server.model
    engine, tokenizer = offline_engine(path, pool_size=4096), engine_tokenizer(str(path))
    prompt = "héllo wörld"
    ids = tokenizer.encode(prompt)
    [expected] = offline_outputs(engine, [ids], greedy(6, logprobs=2, prompt_logprobs=2, ignore_eos=True))
    request = dict(model=path.name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, echo=True)
    for stream in (False, True):
        for sent in (prompt, ids):
            what = f"echo (stream={stream}, a {'text' if sent is prompt else 'token-id'} prompt)"
            text, _ = logprob_rows(client, "completion", stream, prompt=sent, **request)
            assert text == prompt + expected.text, (
                f"{what}: the text should be the prompt {prompt!r} then the answer {expected.text!r}, got {text!r}"
            )
        what = f"echo with logprobs=2 (stream={stream})"
        text, rows = logprob_rows(client, "completion", stream, prompt=prompt, logprobs=2, **request)
        assert text == prompt + expected.text, f"{what}: the text {text!r}, expected the prompt then the answer"
        assert len(rows) == len(ids) + len(expected.output_ids), (
            f"{what}: {len(rows)} entries; expected one per prompt token ({len(ids)}), then one per answer token "
            f"({len(expected.output_ids)}); echo with logprobs must ask the engine for prompt_logprobs"
        )
        first, prompt_rows, answer_rows = rows[0], rows[1 : len(ids)], rows[len(ids) :]
        assert first[1] is None and first[2] is None, (
            f"{what}: the first prompt token has no logprob and no alternatives (null), got {first[1:3]}"
        )
        for i, (row, entry) in enumerate(zip(prompt_rows, expected.prompt_logprobs[1:]), start=1):
            want = tokenizer.token_pieces([entry.token_id])[0][1]
            assert row[0] == want and abs(row[1] - entry.logprob) < 1e-4, (
                f"{what}: prompt entry {i} is {row[0]!r} with {row[1]}; the offline engine's prompt_logprobs say "
                f"{want!r} with {entry.logprob:.6f}"
            )
            tops = [tokenizer.token_pieces([t])[0][1] for t, _ in entry.top]
            assert [a for a, _ in row[2]] == tops, f"{what}: prompt entry {i}'s alternatives {row[2]}, expected {tops}"
        for i, (row, entry) in enumerate(zip(answer_rows, expected.logprobs)):
            assert abs(row[1] - entry.logprob) < 1e-4, (
                f"{what}: answer entry {i} has {row[1]}, the offline engine's {entry.logprob:.6f}"
            )
        assert b"".join(row[0] for row in rows).decode("utf-8", "replace") == text, (
            f"{what}: the entries' bytes joined should spell the text {text!r}"
        )
        offsets = [row[3] for row in rows]
        assert offsets[0] == 0 and offsets == sorted(offsets) and answer_rows[0][3] == len(prompt), (
            f"{what}: text_offset counts from the echoed prompt's start: the answer's first token at {len(prompt)}; "
            f"got {offsets}"
        )
    answer = client.completions.create(prompt=prompt, n=2, **request)
    assert [c.text for c in answer.choices] == [prompt + expected.text] * 2, (
        f"echo with n=2: each choice starts with the prompt; got {[c.text for c in answer.choices]}"
    )
    assert answer.usage.prompt_tokens == len(ids), f"echo does not change usage: {answer.usage}"


def test_scoring_as_lm_eval_does(tiny_server):
    """lm-eval's local-completions scores a continuation with one request per batch of contexts +
    continuations as token ids, echo, logprobs 1, max_tokens 1, and reads token_logprobs[ctxlen:-1]
    (prompt + 1 entries: the generated token's last, even an EOS): the sums are transformers'
    log-likelihoods of the continuations, and "is greedy" (each continuation token the likeliest)
    agrees with transformers' argmax."""
    path = tiny_server.model
    tokenizer = engine_tokenizer(str(path))
    context = tokenizer.encode("The quick brown fox")
    prompts = [context + tokenizer.encode(ending) for ending in (" jumps over", " sleeps", "\n")]
    body = dict(model=path.name, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
    answer = post(tiny_server, "/v1/completions", body)
    assert answer.status_code == 200, f"lm-eval's scoring request got {answer.status_code}: {answer.text[:300]}"
    choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
    for i, (choice, prompt) in enumerate(zip(choices, prompts)):
        shown = choice["logprobs"]
        assert len(shown["token_logprobs"]) == len(prompt) + 1, (
            f"prompt {i}: echo with max_tokens 1 gives one entry per prompt token and one for the generated token "
            f"({len(prompt) + 1}), got {len(shown['token_logprobs'])} (finish {choice['finish_reason']})"
        )
        scored = shown["token_logprobs"][len(context) : -1]
        expected = hf_prompt_logprobs(path, prompt)  # row p scores prompt[p + 1]
        wanted = [expected[p - 1, prompt[p]].item() for p in range(len(context), len(prompt))]
        assert abs(sum(scored) - sum(wanted)) < 1e-3, (
            f"prompt {i}: the continuation's log-likelihood is {sum(scored):.5f}, transformers' {sum(wanted):.5f}"
        )
        tops = shown["top_logprobs"][len(context) : -1]
        greedy = all(value == max(top.values()) for value, top in zip(scored, tops))
        hf_greedy = all(expected[p - 1].argmax().item() == prompt[p] for p in range(len(context), len(prompt)))
        assert greedy == hf_greedy, f"prompt {i}: is_greedy {greedy}, transformers says {hf_greedy}"
    eos = min(tokenizer.eos_token_ids)  # the generated token forced to be EOS: its entry still counts
    forced = post(tiny_server, "/v1/completions", {**body, "prompt": prompts[0], "logit_bias": {str(eos): 100}})
    [choice] = forced.json()["choices"]
    entries = choice["logprobs"]["token_logprobs"]
    assert choice["finish_reason"] == "stop" and len(entries) == len(prompts[0]) + 1, (
        f"a generated EOS has its entry too (no text): {len(prompts[0]) + 1} entries expected, got {len(entries)} "
        f"(finish {choice['finish_reason']})"
    )


def test_a_batch_of_prompts(tiny_server):
    """A completion's prompt may be a batch (strings and token-id lists): choice i * n + j is prompt
    i's j-th, each the offline engine's answer for that prompt with seed + j, usage counting each
    prompt once and every choice's tokens; streamed, each chunk names its choice's index."""
    client, path = client_for(tiny_server), tiny_server.model
    engine, tokenizer = offline_engine(path, pool_size=4096), engine_tokenizer(str(path))
    prompts = ["Hello", tokenizer.encode("héllo wörld"), "a\nb"]
    ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    n = 2
    params = [SamplingParams(temperature=0.9, seed=7 + j, max_new_tokens=6, ignore_eos=True) for j in range(n)]
    expected = offline_outputs(engine, [p for p in ids for _ in range(n)], params * len(prompts))
    request = dict(model=path.name, prompt=prompts, n=n, max_tokens=6, temperature=0.9, seed=7)
    answer = client.completions.create(**request, extra_body={"ignore_eos": True})
    got = [(c.index, c.text) for c in answer.choices]
    assert got == [(i, e.text) for i, e in enumerate(expected)], (
        f"a batch of 3 prompts with n=2: choice i * 2 + j is prompt i's answer with seed 7 + j "
        f"{[e.text for e in expected]}; got {got}"
    )
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        sum(map(len, ids)),
        sum(e.output_tokens for e in expected),
    ), f"usage counts each prompt once ({sum(map(len, ids))} tokens) and every choice's tokens; got {usage}"
    texts = [""] * len(expected)
    for chunk in client.completions.create(**request, stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [e.text for e in expected], (
        f"streamed, the {len(expected)} choices' texts should be {[e.text for e in expected]}, got {texts}: each chunk "
        "names its choice (index), and the stream goes on until every choice has finished, not only the first"
    )


@pytest.mark.parametrize(
    "prompt, says",
    [
        ([], "must not be empty"),
        (["a", []], r"prompt\.1 must not be empty"),
        ([[1, 2], [3, "x"]], r"prompt\.1: token ids must be integers"),
        ([[1, -2]], r"must be in \[0, "),
        (["a"] * 65, "at most 64 prompts"),
        ([[10**9]], r"must be in \[0, "),
        ([[[1]]], "token ids must be integers"),
    ],
)
def test_a_bad_batch_of_prompts_is_refused(tiny_server, prompt, says):
    answer = post(tiny_server, "/v1/completions", {"model": tiny_server.model.name, "prompt": prompt, "max_tokens": 2})
    assert answer.status_code == 400 and re.search(says, answer.json()["error"]["message"]), (
        f"prompt={prompt!r:.60} should be a 400 saying {says!r}; got {answer.status_code}: {answer.text[:200]}"
    )


def test_a_batch_the_server_can_never_hold_is_a_400(tiny_server):
    """64 prompts x n=16 are more engine requests than the tiny server runs and queues at once
    (48 + 256): not a 503 a client would retry forever, but a 400 that says what to send instead."""
    body = {"model": tiny_server.model.name, "prompt": ["a"] * 64, "n": 16, "max_tokens": 1}
    answer = post(tiny_server, "/v1/completions", body)
    assert answer.status_code == 400 and "fewer prompts or a smaller n" in answer.text, (
        f"64 prompts x n=16 should be a 400 naming the limit; got {answer.status_code}: {answer.text[:200]}"
    )
    assert answer.json()["error"]["param"] == "n", f"the error names n: {answer.text[:200]}"


def test_n_choices_each_follow_their_own_seed(tiny_server):
    """n choices: numbered 0..n-1, choice i what the offline engine gives with seed + i, the prompt
    counted once in usage and every choice's tokens in completion_tokens; streamed (with logprobs),
    each choice's chunks carry its index, its own entries, and end once."""
    client, path = client_for(tiny_server), tiny_server.model
    engine, tokenizer = offline_engine(path, pool_size=4096), engine_tokenizer(str(path))
    messages = [{"role": "user", "content": "Tell me about ünïcode."}]
    sampled = [SamplingParams(temperature=0.9, seed=40 + i, max_new_tokens=12) for i in range(3)]
    expected = offline_outputs(engine, [messages] * 3, sampled)
    answer = client.chat.completions.create(
        model=path.name, messages=messages, max_tokens=12, temperature=0.9, seed=40, n=3
    )
    assert [c.index for c in answer.choices] == [0, 1, 2], f"n=3 gives choices 0, 1, 2; got {answer.choices}"
    for choice, want in zip(answer.choices, expected):
        assert (choice.message.content, choice.finish_reason) == (want.text, want.finish_reason.type), (
            f"choice {choice.index} of n=3 with seed 40 should be the offline engine's answer with seed "
            f"{40 + choice.index}: {want.text!r} ({want.finish_reason}); got {choice.message.content!r}"
        )
    assert len({c.message.content for c in answer.choices}) > 1, "three sampled choices came back identical"
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        expected[0].prompt_tokens,
        sum(e.output_tokens for e in expected),
    ), f"usage counts the prompt once and every choice's tokens; got {usage}"

    prompt = "héllo"
    params = [
        SamplingParams(temperature=0.9, seed=7 + i, max_new_tokens=10, ignore_eos=True, logprobs=1) for i in (0, 1)
    ]
    expected = offline_outputs(engine, [tokenizer.encode(prompt)] * 2, params)
    request = dict(
        model=path.name,
        prompt=prompt,
        max_tokens=10,
        temperature=0.9,
        seed=7,
        n=2,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk.model_dump() for chunk in client.completions.create(**request)]
    check_stream_shape(chunks, "completion", request, "a streamed completion with n=2")
    texts, entries = ["", ""], [[], []]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            entries[choice["index"]] += (choice["logprobs"] or {}).get("token_logprobs", [])
    for i, want in enumerate(expected):
        assert texts[i] == want.text, (
            f"streamed choice {i}: {texts[i]!r}, the offline engine's (seed {7 + i}) {want.text!r}"
        )
        values = [e.logprob for e in want.logprobs]
        assert len(entries[i]) == len(values) and all(abs(a - b) < 1e-4 for a, b in zip(entries[i], values)), (
            f"streamed choice {i}: its chunks carry the logprobs {entries[i]}, the offline engine's are {values}"
        )
    assert chunks[-1]["usage"]["completion_tokens"] == 20, f"two choices of 10 tokens: {chunks[-1]['usage']}"
