"""Soak a `pagedserve serve` on the CPU: a bounded loop of mixed valid, invalid, cancelled and
streamed requests, for --minutes, at --concurrency clients. Reports errors by kind, latency
percentiles per window, and the server's resident memory per window (it must not grow):

    python benchmarks/soak.py --minutes 10 [--model DIR] [--concurrency 8]

It starts the server itself (loopback only) and stops it at the end; nothing else is
contacted. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

KINDS = ("complete", "stream", "chat", "cancel", "invalid")
INVALID = [  # bodies that must get a 4xx and leave the server serving
    {"prompt": "Hello", "seed": 2**64}, {"prompt": "Hello", "stop_token_ids": [10**7]},
    {"prompt": "Hello", "cache_salt": "\ud800"}, {"prompt": [True, 1.5]},
    {"prompt": "x", "max_tokens": -1}, {"messages": [{"role": "user"}]},
    {"prompt": "Hello", "n": 10**6}, {"prompt": "Hello", "temperature": "hot"},
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random
              ) -> tuple[str, float]:
    """(outcome, seconds): "ok", "4xx" for an invalid request answered as one, else an error."""
    prompt = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and"])
                      for _ in range(rng.randint(3, 60)))
    body: dict = {"prompt": prompt, "max_tokens": rng.randint(1, 32), "temperature": 0.7}
    path = "/v1/completions"
    if kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                              "max_tokens": body["max_tokens"]}
    elif kind == "invalid":
        body = rng.choice(INVALID)
        path = "/v1/chat/completions" if "messages" in body else path
    start = time.perf_counter()
    try:
        if kind in ("stream", "cancel"):
            body["stream"] = True
            async with client.stream("POST", url + path, content=json.dumps(body),
                                     headers={"content-type": "application/json"}) as reply:
                if reply.status_code != 200:
                    return f"http {reply.status_code}", time.perf_counter() - start
                chunks = 0
                async for line in reply.aiter_lines():
                    chunks += line.startswith("data: ")
                    if kind == "cancel" and chunks >= 2:
                        break  # the client leaves mid-stream
            return "ok", time.perf_counter() - start
        reply = await client.post(url + path, content=json.dumps(body),
                                  headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}", time.perf_counter() - start
    seconds = time.perf_counter() - start
    if kind == "invalid":
        return ("4xx" if 400 <= reply.status_code < 500 else f"http {reply.status_code}"), seconds
    return ("ok" if reply.status_code == 200 else f"http {reply.status_code}"), seconds


async def soak(url: str, pid: int, minutes: float, concurrency: int, window_s: float,
               seed: int) -> dict:
    rng = random.Random(seed)
    end = time.monotonic() + 60 * minutes
    outcomes: Counter[str] = Counter()
    windows: list[dict] = []
    latencies: list[float] = []
    window_end = time.monotonic() + window_s
    lock = asyncio.Lock()

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal window_end, latencies
        while time.monotonic() < end:
            kind = rng.choices(KINDS, weights=(3, 3, 2, 1, 1))[0]
            outcome, seconds = await one(client, url, kind, rng)
            async with lock:
                outcomes[f"{kind}: {outcome}"] += 1
                if outcome == "ok" and kind != "cancel":
                    latencies.append(seconds)
                if time.monotonic() >= window_end:
                    windows.append(_window(len(windows), latencies, rss_mib(pid)))
                    print(json.dumps(windows[-1]), file=sys.stderr)
                    latencies, window_end = [], window_end + window_s

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    health = httpx.get(url + "/health", timeout=30).status_code
    metrics = httpx.get(url + "/metrics", timeout=30).text
    idle = [line for line in metrics.splitlines() if line.startswith(
        ("pagedserve:num_requests_running", "pagedserve:num_requests_waiting",
         "pagedserve:kv_cache_usage_perc"))]
    return {"outcomes": dict(sorted(outcomes.items())), "windows": windows, "health": health,
            "idle_metrics": idle}


def _window(index: int, latencies: list[float], rss: float) -> dict:
    ms = np.array(latencies) * 1e3 if latencies else np.array([float("nan")])
    return {"window": index, "requests": len(latencies), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "rss_mib": round(rss, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per report row")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    cmd = [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", "--port",
           str(args.port), "--device", "cpu", "--kv-cache-memory", "256MiB"]
    if args.model:
        cmd += ["--model", args.model]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        start_rss = rss_mib(server.pid)
        result = asyncio.run(soak(url, server.pid, args.minutes, args.concurrency, args.window,
                                  args.seed))
        result["rss_mib_at_start"] = round(start_rss, 1)
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    bad = {k: v for k, v in result["outcomes"].items() if not k.endswith((": ok", ": 4xx"))}
    return 0 if not bad and result["health"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
