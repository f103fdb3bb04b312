"""How long a large, valid request body holds the API server's event loop (stage 9's body reader).

    python tools/benchmark_large_bodies.py                       # starts a server on the default model
    python tools/benchmark_large_bodies.py --server-args "--disable-overlap"

One event loop writes every stream the server sends, so while it parses a body no client hears
anything. For each body below, one stream runs (a completion of 400 tokens), a client asks
``GET /v1/models`` every 10 ms (the loop alone answers it), and the body is posted; it prints
the body's answer, ``/v1/models``' slowest answer (the loop's stall) and the stream's longest gap
(the loop's stall, or a step of the engine's), each beside the same before the post:

    messages     65,536 one-character messages (refused: more than the context holds)
    parts        100 messages of 1,024 empty content parts (answered)
    logit_bias   262,144 entries (refused: keys past the vocabulary)

``--scale 0.01`` makes every body a hundredth of that (the tests' smoke run). The README's threat
table (stage 9, "What can go wrong in a server") has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import impl_switch  # noqa: E402

impl_switch.install()

import httpx  # noqa: E402

from s00_foundation.paths import default_model_path  # noqa: E402
from s09_zmq_serving.server_process import ServerProcess  # noqa: E402


def bodies(model: str, scale: float) -> dict[str, dict]:
    """name -> a chat's body, each a few MB of small JSON items at scale 1."""
    n = lambda count: max(1, int(count * scale))  # noqa: E731
    chat = {"model": model, "max_tokens": 1}
    return {
        "messages": {**chat, "messages": [{"role": "user", "content": "x"}] * n(65536)},
        "parts": {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 1024}] * n(100)},
        "logit_bias": {
            **chat,
            "messages": [{"role": "user", "content": "x"}],
            "logit_bias": {str(i): 1 for i in range(n(262144))},
        },
    }


def measure(url: str, model: str, body: dict) -> dict:
    """Post ``body`` while a stream runs and /v1/models is asked every 10 ms."""
    gaps: list[float] = []
    pings: list[float] = []
    stop = threading.Event()

    def stream() -> None:
        ask = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=ask, timeout=300) as answer:
            last = time.perf_counter()
            for _ in answer.iter_lines():
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                if stop.is_set():
                    break

    def ping() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get(url + "/v1/models")
                pings.append(time.perf_counter() - start)
                time.sleep(0.01)

    streamer, pinger = threading.Thread(target=stream), threading.Thread(target=ping)
    streamer.start()
    pinger.start()
    time.sleep(1.5)  # the stream's first tokens and a hundred pings, before the post
    gaps_before, pings_before = len(gaps), len(pings)
    raw = json.dumps(body).encode()
    start = time.perf_counter()
    answer = httpx.post(
        url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=300
    )
    took = time.perf_counter() - start
    time.sleep(0.5)
    stop.set()
    streamer.join()
    pinger.join()
    return {
        "mib": len(raw) / 2**20,
        "status": answer.status_code,
        "seconds": took,
        "models_slowest_s": max(pings[pings_before:], default=0.0),
        "models_slowest_before_s": max(pings[:pings_before], default=0.0),
        # None: the stream had ended before the post (a tiny model's 400 tokens take a blink)
        "stream_gap_s": max(gaps[gaps_before:], default=None),
        "stream_gap_before_s": max(gaps[1:gaps_before], default=None),  # (the first is the prefill)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the course's default model)")
    parser.add_argument("--server-args", default="", help="more flags for the server it starts")
    parser.add_argument("--scale", type=float, default=1.0, help="each body's item count times this")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    folder = str(args.model or default_model_path())
    rows = {}
    with tempfile.NamedTemporaryFile("w", prefix="large-bodies-server-", suffix=".log", delete=False) as log:
        server = ServerProcess(["--model", folder, *args.server_args.split()], log=log)
        try:
            server.wait_ready()
            model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
            load = os.getloadavg()[0]
            print(f"server on {folder} (its log: {log.name}); load average {load:.2f}")
            print(
                f"{'body':>11} {'MiB':>5} {'answer':>6} {'took s':>7}   /v1/models' slowest s (before)   "
                "stream's longest gap s (before)"
            )
            for name, body in bodies(model, args.scale).items():
                row = rows[name] = measure(server.base_url, model, body)
                gap, gap_before = (
                    "ended" if value is None else f"{value:.2f}"
                    for value in (row["stream_gap_s"], row["stream_gap_before_s"])
                )
                print(
                    f"{name:>11} {row['mib']:5.2f} {row['status']:>6} {row['seconds']:7.2f}   "
                    f"{row['models_slowest_s']:8.2f} ({row['models_slowest_before_s']:.2f})"
                    f"{'':>17}{gap:>8} ({gap_before})",
                    flush=True,
                )
        finally:
            server.stop()
    if args.json is not None:
        args.json.write_text(json.dumps({"load_average": os.getloadavg()[0], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
