"""Load generator for a running `pagedserve serve` (or any OpenAI-compatible server).

Streams /v1/completions requests at several concurrencies and prints request throughput,
output tokens/s, and time to first token / time per output token (p50, p99):

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --concurrency 1,4,16 \\
        --num-requests 32 --input-len 64 --output-len 32

Prompts are random words cut to exactly --input-len tokens with the server's /tokenize, a
different one per request (so the prefix cache does not help); ignore_eos keeps every output
exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river mountain light "
         "music garden window paper story table city ocean forest winter summer engine signal "
         "market history language system voice animal").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0  # seconds to the first streamed token
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[index]


async def make_prompts(client: httpx.AsyncClient, url: str, model: str | None, count: int,
                       input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        resp = await client.post(url + "/tokenize", json={"model": model, "prompt": text})
        resp.raise_for_status()
        prompts.append(resp.json()["tokens"][:input_len])
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, model: str | None,
                      prompt: list[int], output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return Result(False, error=f"{resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return Result(False, error=repr(exc))
    latency = time.perf_counter() - start
    return Result(True, ttft if ttft is not None else latency, latency, tokens)


async def run_level(client: httpx.AsyncClient, url: str, model: str | None,
                    prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    semaphore = asyncio.Semaphore(concurrency)

    async def limited(prompt: list[int]) -> Result:
        async with semaphore:
            return await one_request(client, url, model, prompt, output_len)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok]
    tpots = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {"concurrency": concurrency, "requests": len(ok), "failed": len(errors),
            "wall_s": wall, "req_per_s": len(ok) / wall, "output_tok_per_s": out_tokens / wall,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "tpot_p50_ms": percentile(tpots, 50), "tpot_p99_ms": percentile(tpots, 99),
            "mean_latency_s": statistics.fmean(r.latency for r in ok) if ok else float("nan"),
            "first_error": errors[0] if errors else ""}


def print_table(rows: list[dict]) -> None:
    header = ("conc", "reqs", "fail", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
              "TPOT p50", "TPOT p99")
    print("  ".join(f"{h:>9}" for h in header) + "   (times in ms)")
    for r in rows:
        cells = (r["concurrency"], r["requests"], r["failed"], f"{r['req_per_s']:.2f}",
                 f"{r['output_tok_per_s']:.1f}", f"{r['ttft_p50_ms']:.0f}",
                 f"{r['ttft_p99_ms']:.0f}", f"{r['tpot_p50_ms']:.1f}",
                 f"{r['tpot_p99_ms']:.1f}")
        print("  ".join(f"{c:>9}" for c in cells))
        if r["first_error"]:
            print(f"    first error: {r['first_error']}")


async def main_async(args: argparse.Namespace) -> list[dict]:
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = [int(c) for c in args.concurrency.split(",")]
    limits = httpx.Limits(max_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        model = args.model
        if model is None:
            models = (await client.get(url + "/v1/models")).json()
            model = models["data"][0]["id"]
        rows = []
        for i, concurrency in enumerate(levels):
            count = args.num_requests or max(8, 4 * concurrency)
            prompts = await make_prompts(client, url, model, count, args.input_len,
                                         args.seed + 1000 * i)
            if i == 0:  # warm up: the first request pays for lazy initialisation
                await one_request(client, url, model, prompts[0], 2)
            rows.append(await run_level(client, url, model, prompts, args.output_len,
                                        concurrency))
            print(f"concurrency {concurrency}: done in {rows[-1]['wall_s']:.1f} s",
                  file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,4,16",
                        help="comma-separated in-flight request counts")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests per level (default: max(8, 4 x concurrency))")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    rows = asyncio.run(main_async(args))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
