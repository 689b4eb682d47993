"""Load sweep against a running `pagedserve serve` (or any OpenAI-compatible server).

Runs `pagedserve bench serve`'s load generator (asyncio + httpx streaming /v1/completions) at
several concurrencies, or at several Poisson request rates, and prints one row per level:
request throughput, output tokens/s, time to first token, time per output token and the gap
between tokens (mean, p50, p99):

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --concurrency 1,4,16 \\
        --input-len 64 --output-len 32
    python benchmarks/serve_bench.py --request-rates 4,16,64 --num-requests 200 \\
        --input-len 1024 --output-len 256

Prompts are random token ids, a different one per request (so the prefix cache does not help);
ignore_eos keeps every output exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from pagedserve.bench import run_serve


def print_table(rows: list[dict]) -> None:
    header = ("level", "reqs", "fail", "req/s", "out tok/s", "TTFT mean", "TTFT p50",
              "TTFT p99", "TPOT mean", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99")
    print("  ".join(f"{h:>9}" for h in header) + "   (times in ms)")
    for r in rows:
        cells = (r["level"], r["completed"] + r["failed"], r["failed"],
                 f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                 f"{r['mean_ttft_ms']:.0f}", f"{r['p50_ttft_ms']:.0f}",
                 f"{r['p99_ttft_ms']:.0f}", f"{r['mean_tpot_ms']:.1f}",
                 f"{r['p50_tpot_ms']:.1f}", f"{r['p99_tpot_ms']:.1f}",
                 f"{r['p50_itl_ms']:.1f}", f"{r['p99_itl_ms']:.1f}")
        print("  ".join(f"{c:>9}" for c in cells))
        if r["first_error"]:
            print(f"    first error: {r['first_error']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,4,16",
                        help="comma-separated in-flight request counts")
    parser.add_argument("--request-rates", default=None,
                        help="comma-separated Poisson request rates (req/s), unbounded "
                             "concurrency; replaces --concurrency")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests per level (default: max(8, 4 x concurrency), or 10 s "
                             "of arrivals at a rate)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens")
    parser.add_argument("--vocab-size", type=int, default=1000,
                        help="prompt token ids are drawn from [0, vocab-size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    if args.request_rates:
        levels = [(f"{float(rate):g}/s", float(rate), None,
                   args.num_requests or max(8, int(10 * rate)))
                  for rate in args.request_rates.split(",")]
    else:
        levels = [(f"c={c}", float("inf"), int(c), args.num_requests or max(8, 4 * int(c)))
                  for c in args.concurrency.split(",")]
    rows = []
    for i, (name, rate, concurrency, num) in enumerate(levels):
        level = argparse.Namespace(
            url=args.url, model=args.model, api_key=args.api_key, timeout=args.timeout,
            num_prompts=num, input_len=args.input_len, output_len=args.output_len,
            vocab_size=args.vocab_size, seed=args.seed + 1000 * i, request_rate=rate,
            max_concurrency=concurrency, ignore_eos=True)
        row = asyncio.run(run_serve(level))
        row["level"] = name
        rows.append(row)
        print(f"{name}: done in {row['duration_s']:.1f} s", file=sys.stderr)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
