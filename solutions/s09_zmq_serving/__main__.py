"""Stage 9 milestone: serve the engine over OpenAI's HTTP API, or (--demo) stream one chat.

    python -m s09_zmq_serving --model models/SmolLM2-135M-Instruct --port 30000 [engine knobs]
    python -m s09_zmq_serving --demo          # start the server, stream one chat through `openai`, stop

Then, while it serves::

    curl http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}], "stream": true}'
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .launch import launch_server
from .server_args import ServerArgs, add_cli_args, from_cli_args

DEMO_QUESTION = "What is the capital of France, and what is it famous for? Answer in two sentences."


def demo(server_args: ServerArgs, argv: list[str], question: str, max_tokens: int) -> int:
    """Start the server (a child process), stream one chat through the official client, stop it."""
    from openai import OpenAI

    from .server_process import ServerProcess

    print(
        f"starting the server on {server_args.model_names()[0]} (the API server, tokenizer, scheduler and "
        "detokenizer processes) ...",
        flush=True,
    )
    with ServerProcess([*argv, "--enable-debug-endpoints"]) as server:  # /debug/state lists the pids
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
        [model] = [m.id for m in client.models.list()]
        print(f"\nuser: {question}\nassistant: ", end="", flush=True)
        start, first, finish, usage = time.perf_counter(), None, None, None
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    print(choice.delta.content, end="", flush=True)
                finish = choice.finish_reason or finish
        elapsed = time.perf_counter() - start
        print(
            f"\n\n[finish_reason={finish}, {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} completion "
            "tokens; "
            f"first text after {1000 * (first - start):.0f} ms, {usage.completion_tokens / elapsed:.1f} tokens/s]"
        )
        pids = server.get("/debug/state")["pids"]
        print("stopping the server ...", flush=True)
    left = [name for name, pid in pids.items() if still_running(pid)]
    print(f"stopped (exit code {server.proc.returncode}); processes left behind: {', '.join(left) or 'none'}")
    return 0 if server.proc.returncode == 0 and not left else 1


def still_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cli_args(parser)
    parser.add_argument(
        "--demo", action="store_true", help="start the server, stream one chat through the openai client, stop it"
    )
    parser.add_argument("--demo-question", default=DEMO_QUESTION)
    parser.add_argument("--demo-max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    server_args = from_cli_args(args)
    if args.demo:
        # The server gets the same flags minus the demo's own (and a free port of its choosing).
        rest, skip = [], False
        for arg in argv:
            if skip:
                skip = False
            elif arg in ("--demo-question", "--demo-max-tokens", "--port", "--host"):
                skip = True
            elif arg != "--demo" and not arg.startswith(("--demo-", "--port=", "--host=")):
                rest.append(arg)
        return demo(server_args, rest, args.demo_question, args.demo_max_tokens)
    return launch_server(server_args)


if __name__ == "__main__":
    sys.exit(main())
