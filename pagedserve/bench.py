"""`pagedserve bench`: offline throughput of the engine and online load against a server.

    pagedserve bench throughput [engine flags] --num-prompts 1000 --input-len 1024 --output-len 128
    pagedserve bench serve --url http://127.0.0.1:8000 --request-rate 8 --num-prompts 200

Prompts are random token ids (a fixed seed), so models without a tokenizer (`random:` models)
work too; EOS is ignored by default so every request produces exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedserve import envs
from pagedserve.arg_utils import HelpFormatter, add_engine_args, check_output_file, make_llm


def random_prompts(num_prompts: int, input_len: int, vocab_size: int,
                   seed: int = 0) -> list[list[int]]:
    """`num_prompts` prompts of `input_len` token ids drawn uniformly from [0, vocab_size)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num_prompts, input_len)).tolist()


# ---- bench throughput ---------------------------------------------------------------------------

def run_throughput(llm: Any, prompts: list[list[int]], output_len: int,
                   ignore_eos: bool = True, use_tqdm: bool = False) -> dict[str, float]:
    """Generate greedily for every prompt at once; the figures `vllm bench throughput` prints."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
    before = llm.engine.call_utility("stats")
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    after = llm.engine.call_utility("stats")
    steps = max(after.num_steps - before.num_steps, 1)
    core_s = after.step_seconds - before.step_seconds
    wait_s = after.wait_seconds - before.wait_seconds
    device_s = after.device_seconds - before.device_seconds
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"num_requests": len(prompts), "elapsed_s": elapsed,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "requests_per_s": len(prompts) / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            # The engine core's host time inside its steps: how much of the run it was busy.
            "core_steps": steps, "core_ms_per_step": core_s / steps * 1e3,
            "core_wait_ms_per_step": wait_s / steps * 1e3, "core_busy": core_s / elapsed,
            # CUDA events around each step's device work (PAGEDSERVE_DEVICE_TIMING=1): the
            # share of the run the GPU was busy; None when not measured.
            "gpu_busy": device_s / elapsed if device_s > 0 else None,
            "gpu_ms_per_step": device_s / steps * 1e3 if device_s > 0 else None,
            **spec_decode_figures(before, after)}


def spec_decode_figures(before: Any, after: Any) -> dict[str, Any]:
    """Speculative decoding's counters over the run (vLLM's names), none without drafts."""
    from pagedserve.spec_decode.metrics import acceptance_rate, mean_acceptance_length

    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    if not drafts:
        return {}
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    per_pos = [a - b for a, b in zip(after.spec_decode_num_accepted_tokens_per_pos,
                                     before.spec_decode_num_accepted_tokens_per_pos or
                                     [0] * len(after.spec_decode_num_accepted_tokens_per_pos),
                                     strict=True)]
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_num_accepted_tokens_per_pos": per_pos,
            "spec_decode_acceptance_rate": acceptance_rate(draft_tokens, accepted),
            # The core's step time is known in process only (not from /metrics).
            "spec_decode_propose_share": (
                (after.spec_decode_propose_seconds - before.spec_decode_propose_seconds)
                / max(after.step_seconds - before.step_seconds, 1e-9))
            if hasattr(after, "step_seconds") else None,
            "spec_decode_mean_acceptance_length": mean_acceptance_length(drafts, accepted)}


def format_throughput(r: dict[str, float]) -> str:
    return (f"Throughput: {r['requests_per_s']:.2f} requests/s, "
            f"{r['total_tokens_per_s']:.2f} total tokens/s, "
            f"{r['output_tokens_per_s']:.2f} output tokens/s\n"
            f"Total num prompt tokens: {r['prompt_tokens']}\n"
            f"Total num output tokens: {r['output_tokens']}\n"
            f"Elapsed: {r['elapsed_s']:.2f} s for {r['num_requests']} requests\n"
            f"Engine core: {r['core_steps']} steps, {r['core_ms_per_step']:.3f} ms per step in "
            f"step() ({r['core_busy']:.0%} of the run), of which "
            f"{r['core_wait_ms_per_step']:.3f} ms waiting for the device"
            + (f"\nGPU busy: {r['gpu_busy']:.1%} of the run ({r['gpu_ms_per_step']:.3f} ms of "
               "device work per step, CUDA events)" if r.get("gpu_busy") is not None else "")
            + (f"\n{format_spec_decode(r)}" if r.get("spec_decode_num_drafts") else ""))


def format_spec_decode(r: dict[str, Any]) -> str:
    share = r.get("spec_decode_propose_share")
    return (f"Speculative decoding: mean acceptance length "
            f"{r['spec_decode_mean_acceptance_length']:.2f}, acceptance rate "
            f"{r['spec_decode_acceptance_rate']:.1%}, per position "
            + ", ".join(f"{n / r['spec_decode_num_drafts']:.3f}"
                        for n in r["spec_decode_num_accepted_tokens_per_pos"])
            + f" ({r['spec_decode_num_drafts']} drafts, {r['spec_decode_num_draft_tokens']} "
            f"draft tokens, {r['spec_decode_num_accepted_tokens']} accepted)"
            + (f"; the proposer {share:.1%} of the engine core's step time"
               if share is not None else ""))


def _cmd_throughput(args: argparse.Namespace) -> int:
    check_output_file(args.output_json, "--output-json", "bench throughput")
    llm = make_llm(args)
    vocab = llm.engine.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed)
    try:  # a refusal (a prompt over the context length, a pooling model) comes before a step
        if args.warmup:  # the first steps pay for lazy initialisation, not the engine
            run_throughput(llm, prompts[:1], 2)
        result = run_throughput(llm, prompts, args.output_len, args.ignore_eos,
                                use_tqdm=sys.stderr.isatty())
    except ValueError as exc:
        raise SystemExit(f"pagedserve bench throughput: error: {exc}") from None
    print(format_throughput(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**result, "input_len": args.input_len, "output_len": args.output_len},
                      f, indent=2)
    return 0


# ---- bench serve --------------------------------------------------------------------------------

@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds to the first streamed token
    latency: float = 0.0  # seconds to the last
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    if not ms:
        nan = float("nan")
        return {f"mean_{name}_ms": nan, f"p50_{name}_ms": nan, f"p99_{name}_ms": nan}
    return {f"mean_{name}_ms": statistics.fmean(ms),
            f"p50_{name}_ms": float(np.percentile(ms, 50)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Request throughput, output tokens/s, and TTFT, TPOT, ITL and end-to-end latency
    (mean, p50, p99, in ms) over the successful requests."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else float("nan"),
        "output_throughput": out_tokens / wall_s if wall_s > 0 else float("nan"),
        "total_output_tokens": out_tokens,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok]))
    summary.update(_stats("tpot", [r.tpot for r in ok if r.tpot is not None]))
    summary.update(_stats("itl", [gap for r in ok for gap in r.itl]))
    summary.update(_stats("e2el", [r.latency for r in ok]))
    errors = [r.error for r in results if not r.ok]
    summary["first_error"] = errors[0] if errors else ""
    return summary


def format_serve(s: dict[str, Any]) -> str:
    lines = [f"Successful requests: {s['completed']}  failed: {s['failed']}",
             f"Duration: {s['duration_s']:.2f} s",
             f"Request throughput: {s['request_throughput']:.2f} req/s",
             f"Output token throughput: {s['output_throughput']:.2f} tok/s"]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                        ("e2el", "E2E latency")):
        lines.append(f"{title:>12} ms: mean {s[f'mean_{name}_ms']:.2f}  "
                     f"p50 {s[f'p50_{name}_ms']:.2f}  p99 {s[f'p99_{name}_ms']:.2f}")
    if s["first_error"]:
        lines.append(f"first error: {s['first_error']}")
    if s.get("spec_decode_num_drafts"):
        lines.append(format_spec_decode(s))
    return "\n".join(lines)


def arrival_delays(num: int, request_rate: float, seed: int) -> list[float]:
    """Gaps before each request: exponential (a Poisson process) at `request_rate`/s, all 0
    when the rate is infinite."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.exponential(1.0 / request_rate, size=num).tolist()


async def sse_data(resp: Any) -> AsyncIterator[str]:
    """The `data:` payloads of a Server-Sent Events body. Lines end at \\n or \\r\\n only, as
    the SSE spec and the openai client have it: the text inside an event's JSON may hold
    U+2028, U+0085 and other characters that str.splitlines() (and httpx's aiter_lines) would
    also break at."""
    buffer = ""
    async for text in resp.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            line = line.removesuffix("\r")
            if line.startswith("data:"):
                yield line[5:].removeprefix(" ")
    if buffer.startswith("data:"):
        yield buffer.removesuffix("\r")[5:].removeprefix(" ")


def _new_tokens(chunk: dict[str, Any]) -> bool:
    """The chunk carries generated tokens: text, or token ids (a model without a tokenizer
    streams those with empty text)."""
    choices = chunk.get("choices") or ()
    return any(c.get("text") or c.get("token_ids") for c in choices)


async def _one_request(client: Any, url: str, model: str | None, prompt: list[int],
                       output_len: int, ignore_eos: bool) -> RequestResult:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, last, tokens, itl = None, start, 0, []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return RequestResult(False, error=f"{resp.status_code}: "
                                                  f"{error_message(await resp.aread())}")
            async for data in sse_data(resp):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                now = time.perf_counter()
                if _new_tokens(chunk):
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc))
    latency = time.perf_counter() - start
    return RequestResult(True, ttft if ttft is not None else latency, latency, tokens, itl)


def error_message(body: bytes) -> str:
    """An error reply's message (OpenAI's shape), else the start of its body."""
    text = body.decode("utf-8", "replace")
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def _first_model(client: Any, url: str) -> str:
    reply = await client.get(url + "/v1/models")
    if reply.status_code != 200:
        raise SystemExit(f"pagedserve bench serve: error: GET {url}/v1/models answered "
                         f"{reply.status_code}: {reply.text[:200]}")
    return reply.json()["data"][0]["id"]


async def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or args.num_prompts
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=limit + 4)) as client:
        model = args.model
        if model is None:
            model = await _first_model(client, url)
        prompts = random_prompts(args.num_prompts, args.input_len, args.vocab_size, args.seed)
        warm = await _one_request(client, url, model, prompts[0], 2, True)
        before = await _spec_counters(client, url)
        if not warm.ok:
            raise SystemExit(f"pagedserve bench serve: the warm-up request failed: {warm.error}")
        semaphore = asyncio.Semaphore(limit)

        async def limited(prompt: list[int]) -> RequestResult:
            async with semaphore:
                return await _one_request(client, url, model, prompt, args.output_len,
                                          args.ignore_eos)

        tasks = []
        start = time.perf_counter()
        for prompt, delay in zip(prompts, arrival_delays(len(prompts), args.request_rate,
                                                          args.seed), strict=True):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        summary = summarize(list(results), time.perf_counter() - start)
        after = await _spec_counters(client, url)
        if before is not None and after is not None:
            summary.update(spec_decode_figures(before, after))
        return summary


async def _spec_counters(client: Any, url: str) -> Any:
    """The server's speculative decoding counters from /metrics (None without them)."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    reply = await client.get(url + "/metrics")
    if reply.status_code != 200:
        return None
    found: dict[str, Any] = {}
    for family in text_string_to_metric_families(reply.text):
        name = family.name.removeprefix("pagedserve:")
        if not name.startswith("spec_decode_"):
            continue
        values = [s for s in family.samples if s.name.endswith("_total")]
        if name.endswith("_per_pos"):
            found[name] = [int(s.value) for s in
                           sorted(values, key=lambda s: int(s.labels["position"]))]
        elif values:
            found[name] = int(values[0].value)
    return SimpleNamespace(**found) if "spec_decode_num_drafts" in found else None


def _cmd_serve(args: argparse.Namespace) -> int:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    check_output_file(args.output_json, "--output-json", "bench serve")
    if args.api_key is None:
        args.api_key = envs.PAGEDSERVE_API_KEY
    try:
        summary = asyncio.run(run_serve(args))
    except httpx.HTTPError as exc:
        raise SystemExit(f"pagedserve bench serve: error: {args.url}: {exc or type(exc).__name__}"
                         " (is a server running there?)") from None
    print(format_serve(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


# ---- parser -------------------------------------------------------------------------------------

def add_bench_parser(subparsers: Any, parents: list[Any] | None = None
                     ) -> argparse.ArgumentParser:
    parents = parents or []
    fmt = HelpFormatter
    bench = subparsers.add_parser("bench", parents=parents,
                                  help="benchmarks: offline throughput, online serving")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    p = sub.add_parser("throughput", parents=parents, formatter_class=fmt,
                       help="offline: random prompts through the engine")
    _workload_args(p, num_prompts=1000, output_len=128)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run one short request before timing")
    p.add_argument("--prompt-seed", type=int, default=0,
                   help="seed of the random prompts (--seed is the engine's)")
    p.add_argument("--output-json", help="also write the figures to this file")
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=_cmd_throughput)

    p = sub.add_parser("serve", parents=parents, formatter_class=fmt,
                       help="online: load against a running OpenAI-compatible server")
    p.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000",
                   help="the server's base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None,
                   help="bearer token (default: $PAGEDSERVE_API_KEY)")
    _workload_args(p, num_prompts=200, output_len=128)
    p.add_argument("--request-rate", type=_positive(float), default=float("inf"),
                   help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=_positive(int), default=None,
                   help="most requests in flight (default: unlimited)")
    p.add_argument("--vocab-size", type=_positive(int), default=1000,
                   help="prompt token ids are drawn from [0, vocab-size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    p.add_argument("--timeout", type=_positive(float), default=600.0,
                   help="seconds per request")
    p.add_argument("--output-json", help="also write the figures to this file")
    p.set_defaults(func=_cmd_serve)
    return bench


def _workload_args(p: argparse.ArgumentParser, num_prompts: int, output_len: int) -> None:
    """Random token-id prompts, with vLLM's names for the same settings beside ours."""
    p.add_argument("--num-prompts", type=_positive(int), default=num_prompts, help="requests")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=_positive(int),
                   default=1024, help="prompt tokens")
    p.add_argument("--output-len", "--random-output-len", dest="output_len",
                   type=_positive(int), default=output_len, help="tokens to generate")
    p.add_argument("--dataset-name", choices=["random"], default="random",
                   help="prompts: random token ids (the only dataset; nothing is downloaded)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens")


def _positive(kind: type) -> Any:
    """An argparse type: a number of `kind` above 0 (argparse names the flag and the value)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value > 0:  # NaN too
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


if __name__ == "__main__":
    sys.exit("run it as `pagedserve bench ...`")
