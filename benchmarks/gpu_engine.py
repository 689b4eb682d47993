"""GPU engine measurement in one run (about 6 minutes on an H200 with the defaults):

    python benchmarks/gpu_engine.py [--num-prompts 256] [--attention-backend TRITON] [--skip-...]

1. SmolLM2-135M-shaped random bf16 model: output tok/s for N x 128 in / 512 out with and without
   CUDA graphs, and whether the greedy tokens of the two runs are identical.
2. Llama-3.1-8B-shaped random bf16 model (the llama3-8b-random preset):
   - `bench throughput` workloads prefill-heavy (N x 1,024 in / 128 out) and decode-heavy
     (N x 128 in / 1,024 out), each next to transformers' static batched `generate` on the
     engine's own weights (a subset of the prompts, one batch) and next to two floors: the
     issue's (prefill FLOPs / matmul rate, plus for every step that decodes max(bytes of
     weights + the decodes' KV / copy bandwidth, their FLOPs / matmul rate)) and a strict one
     (every step at max(its bytes, its FLOPs)), both rates measured here;
   - one decode step at batch 128 and 256 with 1,024-token contexts, next to its floor;
   - the graph's GPU time alone and the eager step's kernels by name;
   - the engine's own decode steps at batch 128 and 256 (1,024-token prompts): wall time per
     step next to its floor, and the fraction of wall time the GPU is busy (torch.profiler
     kernel time over a window of steps).
A compact table closes the run. Every part can be skipped by a flag.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.bench import random_prompts, run_throughput  # noqa: E402
from pagedserve.engine.cuda_graphs import padded_batch_size  # noqa: E402

ROWS: list[tuple[str, str, str]] = []  # (what, measured, next to)


def row(what: str, measured: str, ref: str = "") -> None:
    ROWS.append((what, measured, ref))
    print(f"  {what}: {measured}  {ref}", flush=True)


def free(llm: LLM | None) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


# ---- ceilings -----------------------------------------------------------------------------------

def measure_rates() -> tuple[float, float]:
    """(bf16 matmul FLOP/s, device copy bytes/s counting read + write)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    flops = 20 * 2 * 8192 ** 3 / (time.perf_counter() - t0)
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 10 * 2 * src.numel() / (time.perf_counter() - t0)
    del a, b, src, dst
    torch.cuda.empty_cache()
    return flops, bw


class Shape:
    """Per-token costs of a Llama-shaped model for the floors."""

    def __init__(self, cfg, model: torch.nn.Module) -> None:
        """`cfg`: the model's Hugging Face config; `model`: its module (parameters on any
        device, `meta` included), with `lm_head` and `model.embed_tokens` as in Llama."""
        embed = cfg.vocab_size * cfg.hidden_size
        # Bytes a step reads: every weight but the embedding table (only rows are gathered),
        # unless it doubles as the head.
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if getattr(model, "lm_head", None) is not None:
            self.weight_bytes -= embed * model.model.embed_tokens.weight.element_size()
        linear = sum(p.numel() for p in model.parameters()) - embed
        if getattr(model, "lm_head", None) is not None:
            linear -= embed  # the head runs once per request, not per token
        self.linear_params = linear
        self.head_params = embed
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.attn = cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
        elem = 2  # bf16 KV
        self.kv_bytes_per_token = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                                   * head_dim * elem)

    def step_cost(self, computed: np.ndarray, scheduled: np.ndarray) -> tuple[float, float]:
        """(FLOPs, bytes) of one step with these per-request cached / new token counts."""
        c, n = computed.astype(np.float64), scheduled.astype(np.float64)
        tokens = n.sum()
        flops = 2 * self.linear_params * tokens + 2 * self.head_params * len(n)
        flops += 4 * self.attn * float((n * c + n * (n + 1) / 2).sum())  # QK^T and PV
        nbytes = self.weight_bytes + self.kv_bytes_per_token * float((c + n).sum())
        return flops, nbytes

    def floor_s(self, step_log: list, flops_rate: float, bw: float) -> float:
        """The strict floor: every step at max(its bytes, its FLOPs), as if a step overlapped
        its prefill compute with its decodes' memory traffic perfectly."""
        total = 0.0
        for computed, scheduled, *_ in step_log:
            flops, nbytes = self.step_cost(computed, scheduled)
            total += max(flops / flops_rate, nbytes / bw)
        return total

    def serial_floor_s(self, step_log: list, flops_rate: float, bw: float) -> float:
        """A floor for an engine that runs a layer's GEMMs and its attention one after the
        other, as this one does: per step, the GEMMs at max(weight bytes / bandwidth, their
        FLOPs / rate) plus attention at max(KV bytes / bandwidth, its FLOPs / rate)."""
        total = 0.0
        for computed, scheduled, *_ in step_log:
            c, n = computed.astype(np.float64), scheduled.astype(np.float64)
            gemm_flops = 2 * self.linear_params * n.sum() + 2 * self.head_params * len(n)
            attn_flops = 4 * self.attn * float((n * c + n * (n + 1) / 2).sum())
            kv_bytes = self.kv_bytes_per_token * float((c + n).sum())
            total += (max(gemm_flops / flops_rate, self.weight_bytes / bw)
                      + max(attn_flops / flops_rate, kv_bytes / bw))
        return total

    def issue_floor_s(self, step_log: list, flops_rate: float, bw: float) -> float:
        """The issue's floor: the prefill tokens' FLOPs at the matmul rate, plus, for every step
        that decodes, max(bytes of weights + the decodes' KV / bandwidth, their FLOPs / rate).
        A request with one scheduled token is a decode (a one-token prompt chunk counts too:
        rare, and it only moves work between the two terms)."""
        total = 0.0
        for computed, scheduled, *_ in step_log:
            decode = scheduled == 1
            if (~decode).any():
                flops, _ = self.step_cost(computed[~decode], scheduled[~decode])
                total += flops / flops_rate
            if decode.any():
                flops, nbytes = self.step_cost(computed[decode], scheduled[decode])
                total += max(flops / flops_rate, nbytes / bw)
        return total


# ---- parts --------------------------------------------------------------------------------------

def small_model(args: argparse.Namespace) -> None:
    print(f"\n== {args.small_model or 'SmolLM2-135M-shaped random bf16'}: graphs vs eager",
          flush=True)
    n, in_len, out_len = args.small_num_prompts, 128, 512
    results = {}
    for eager in (False, True):
        llm = LLM(config="smollm2-random-gpu", model=args.small_model,
                  attention_backend=args.attention_backend, enforce_eager=eager,
                  kv_cache_dtype=args.kv_cache_dtype,
                  gpu_memory_utilization=0.3, async_scheduling=args.async_scheduling)
        graphs = llm.engine.runner.decode_graphs
        if not eager and graphs is None:
            row("small: CUDA graphs", "NOT CAPTURED (see warning above)")
        prompts = random_prompts(n, in_len, llm.engine.runner.vocab_size, seed=1)
        # The same prompts with a few tokens first: every kernel the run launches (prefill
        # chunk shapes included) is compiled before the clock starts.
        run_throughput(llm, prompts, 8)
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        with step_events(llm.engine.runner) as events:
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            wall = time.perf_counter() - t0
        busy = sum(start.elapsed_time(end) for start, end in events) / 1e3 / wall
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        results[eager] = tokens
        tps = sum(map(len, tokens)) / wall
        row(f"small {n}x{in_len}/{out_len} {'eager' if eager else 'graphs'}",
            f"{tps:,.0f} out tok/s", f"({wall:.1f} s, {len(events)} steps, GPU busy {busy:.0%})")
        # Drop every reference here (free() only drops its own) so the next engine's memory
        # profile does not see this one's KV cache and graph pool.
        del llm, graphs, outs
        free(None)
    same = sum(a == b for a, b in zip(results[False], results[True], strict=True))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                  for a, b in zip(results[False], results[True], strict=True)]
    diffs = [d for d in first_diff if d is not None]
    row("small greedy graphs == eager", f"{same}/{n} sequences identical",
        f"(earliest divergence at token {min(diffs)})" if diffs else "")


def hf_generate(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """transformers' static batched greedy generate on the engine's own weights (shared
    storage, no copy); returns output tok/s."""
    import transformers

    from pagedserve.models.checkpoint_loading import hf_state_dict

    cfg = llm.engine.loaded.hf_config
    device = llm.engine.runner.device
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(cfg)
    hf.load_state_dict(hf_state_dict(llm.engine.runner.model), strict=False, assign=True)
    with torch.device(device):  # its inv_freq buffer was left on the meta device
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
    hf.eval()
    ids = torch.tensor(prompts, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  max_new_tokens=output_len, min_new_tokens=output_len)
    with torch.inference_mode():
        hf.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4,
                                    "attention_mask": torch.ones_like(ids[:, :16])})
        sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        sync()
        wall = time.perf_counter() - t0
    new = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del hf, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return new / wall


def workload(llm: LLM, shape: Shape, name: str, n: int, in_len: int, out_len: int,
             rates: tuple[float, float], args: argparse.Namespace) -> None:
    runner = llm.engine.runner
    prompts = random_prompts(n, in_len, runner.vocab_size, seed=in_len + out_len)
    runner.step_log = []
    with step_events(runner) as events:
        r = run_throughput(llm, prompts, out_len)
    log, runner.step_log = runner.step_log, None
    floor = shape.floor_s(log, *rates)
    issue_floor = shape.issue_floor_s(log, *rates)
    serial = shape.serial_floor_s(log, *rates)
    graphed = sum(1 for *_, ran in log if ran)
    wall = r["elapsed_s"]
    row(f"8B {name} {n}x{in_len}/{out_len}",
        f"{r['output_tokens_per_s']:,.0f} out tok/s, {r['total_tokens_per_s']:,.0f} tot tok/s, "
        f"{wall:.1f} s", f"issue's floor {issue_floor:.1f} s -> wall/floor "
        f"{wall / issue_floor:.2f}; strict floor (max per step) {floor:.1f} s -> "
        f"{wall / floor:.2f} ({len(log)} steps, {graphed} graphed)")
    row(f"8B {name} next to a serial floor", f"{serial:.1f} s -> wall/floor {wall / serial:.2f}",
        "(per step: GEMMs at max(weights, FLOPs) + attention at max(KV, FLOPs))")
    busy_s = sum(start.elapsed_time(end) for start, end in events) / 1e3
    row(f"8B GPU busy in the {name} run", f"{busy_s / wall:.0%}",
        f"(CUDA events around each step's work: {busy_s:.1f} s of {wall:.1f} s wall)")
    if not args.skip_hf:
        m = min(args.hf_num_prompts, n)
        hf_out = out_len if out_len <= args.hf_max_output_len else args.hf_max_output_len
        try:
            tps = hf_generate(llm, prompts[:m], hf_out)
            row(f"8B {name} transformers generate", f"{tps:,.0f} out tok/s",
                f"({m} prompts x {in_len}/{hf_out}, one batch)")
        except Exception as exc:  # report and go on: the engine figures still count
            row(f"8B {name} transformers generate", f"failed: {type(exc).__name__}: {exc}")
            gc.collect()
            torch.cuda.empty_cache()


@contextlib.contextmanager
def step_events(runner):
    """The runner's CUDA events around each step's device work (from the forward, once the
    host has built the step's metadata, to the samples' copy). Steps run on one stream, so
    their spans do not overlap: their sum over the wall time is the fraction of it the GPU
    is busy, and a gap is the GPU waiting for the host."""
    from pagedserve.engine.device_timer import DeviceTimer

    saved, runner.device_timer = runner.device_timer, DeviceTimer(keep_spans=True)
    try:
        yield runner.device_timer.spans
    finally:
        runner.device_timer = saved
        torch.cuda.synchronize()


@torch.inference_mode()
def decode_step_time(llm: LLM, shape: Shape, batch: int, context: int,
                     rates: tuple[float, float]) -> None:
    """One decode step (backend metadata, forward by graph when captured, logits, argmax, the
    id copy; not the scheduler or the common metadata build) over `batch` requests of `context`
    cached tokens laid out in the cache while no request runs (it overwrites blocks the prefix
    cache may still list: later prompts here are random, so none hits them)."""
    from pagedserve.engine.cuda_graphs import DecodeGraphs

    runner = llm.engine.runner
    graphs = runner.decode_graphs
    helper = graphs or DecodeGraphs(runner.graph_inputs(), [batch], capture=False)
    if (context // runner.block_size + 1) * batch > runner.num_blocks:
        row(f"8B decode step b={batch}", "skipped: the KV cache is too small")
        return

    commons = helper.dummy_decode(batch, [context] * batch)  # one per KV cache group

    def step() -> None:
        hidden = graphs.run(commons) if graphs is not None else None
        if hidden is None:
            md = runner.graph_inputs().group_metadata(commons, lambda b, c: b.build(c))
            hidden = runner.run_model(md, batch)
        runner.model.compute_logits(hidden).argmax(-1).cpu()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    iters = 20
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    ms = (time.perf_counter() - t0) / iters * 1e3
    flops, nbytes = shape.step_cost(np.full(batch, context), np.ones(batch))
    floor_ms = max(flops / rates[0], nbytes / rates[1]) * 1e3
    mode = "graph" if graphs is not None and batch <= max(graphs.sizes) else "eager"
    row(f"8B decode step b={batch} ctx={context} ({mode})", f"{ms:.2f} ms",
        f"floor {floor_ms:.2f} ms ({nbytes / 1e9:.1f} GB) -> {ms / floor_ms:.2f}x")
    if mode == "graph":
        gpu_ms = replay_time_ms(graphs, commons)
        row(f"8B decode step b={batch} GPU time of the graph alone", f"{gpu_ms:.2f} ms",
            f"-> {gpu_ms / floor_ms:.2f}x the floor; host and logits {ms - gpu_ms:.2f} ms")
    kernel_breakdown(runner, commons, batch)


def replay_time_ms(graphs, commons) -> float:
    """GPU time of one replay: back-to-back replays between two events, so no host gap."""
    graphs.run(commons)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    size = padded_batch_size(graphs.sizes, commons[0].num_reqs)
    iters = 20
    start.record()
    for _ in range(iters):
        graphs.graphs[size].replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def kernel_breakdown(runner, commons, batch: int, top: int = 8) -> None:
    """Kernels of one eager decode step by name (torch.profiler): where the GPU time goes."""
    from torch.profiler import ProfilerActivity, profile


    def forward() -> None:
        md = runner.graph_inputs().group_metadata(commons, lambda b, c: b.build(c))
        hidden = runner.run_model(md, batch)
        runner.model.compute_logits(hidden).argmax(-1)

    forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    kernels = [(float(getattr(e, "self_device_time_total", 0) or 0), e.count, e.key)
               for e in prof.key_averages()]
    kernels = sorted((k for k in kernels if k[0] > 0), reverse=True)
    total = sum(k[0] for k in kernels)
    row(f"8B eager decode step b={batch} kernels", f"{total / 1e3:.2f} ms GPU",
        f"({len(kernels)} kernel names)")
    for us, count, name in kernels[:top]:
        row(f"  {name[:60]}", f"{us / 1e3:.3f} ms", f"{us / total:.0%}, {count} launches")


def engine_decode(llm: LLM, shape: Shape, rates: tuple[float, float], batch: int,
                  context: int, steps: int = 40) -> None:
    """The engine's own decode steps (scheduler, metadata, graph, sampling, outputs) over
    `batch` requests with `context`-token prompts, once all have been prefilled: wall time per
    step next to the floor of the same steps, then the fraction of wall time the GPU is busy
    (torch.profiler kernel time over the same number of steps)."""
    from torch.profiler import ProfilerActivity, profile

    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 40, ignore_eos=True)
    prompts = random_prompts(batch, context, runner.vocab_size, seed=batch)
    for i, p in enumerate(prompts):
        engine.add_request(f"decode-{batch}-{i}", p, params, stream=False)
    while any(not s.token_ids for st in engine.output_processor.states.values()
              for s in st.sequences):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    runner.step_log = []
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    log, runner.step_log = runner.step_log, None
    floor = shape.floor_s(log, *rates)
    row(f"8B engine decode step b={batch} ctx~{context}",
        f"{wall / steps * 1e3:.2f} ms", f"floor {floor / len(log) * 1e3:.2f} ms -> "
        f"{wall / floor:.2f}x ({sum(1 for *_, g in log if g)}/{len(log)} graphed)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    kernel_us = sum(float(getattr(e, "self_device_time_total", 0) or 0)
                    for e in prof.key_averages())
    row(f"8B GPU busy in engine decode steps b={batch}",
        f"{kernel_us / 1e6 / wall:.0%}" if kernel_us > 0 else "n/a (the profiler saw no kernels)",
        f"({wall / steps * 1e3:.2f} ms/step with the profiler on)")
    # Per step, by kernel name: what the graph, the head and the sampler spend.
    kernels = sorted(((float(getattr(e, "self_device_time_total", 0) or 0), e.count, e.key)
                      for e in prof.key_averages()), reverse=True)
    for us, count, name in [k for k in kernels if k[0] > 0][:12]:
        row(f"  b={batch} per step: {name[:56]}", f"{us / steps / 1e3:.3f} ms",
            f"{count / steps:.0f} launches")


def big_model(args: argparse.Namespace, rates: tuple[float, float]) -> None:
    print("\n== Llama-3.1-8B-shaped random bf16", flush=True)
    t0 = time.perf_counter()
    llm = LLM(config="llama3-8b-random",
              attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    row("8B engine start-up (weights, profile, KV, graphs)", f"{time.perf_counter() - t0:.1f} s",
        f"graphs: {'on' if llm.engine.runner.decode_graphs else 'OFF'}")
    shape = Shape(llm.engine.loaded.hf_config, llm.engine.runner.model)
    run_throughput(llm, random_prompts(2, 32, llm.engine.runner.vocab_size, 0), 4)
    n = args.num_prompts
    if not args.skip_prefill_heavy:
        workload(llm, shape, "prefill-heavy", n, 1024, 128, rates, args)
    if not args.skip_decode_heavy:
        workload(llm, shape, "decode-heavy", n, 128, args.decode_output_len, rates, args)
    for batch in (128, 256):
        if not args.skip_step_time:
            decode_step_time(llm, shape, batch, 1024, rates)
        if not args.skip_busy:
            for context in map(int, args.busy_contexts.split(",")):
                engine_decode(llm, shape, rates, batch, context)
    free(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=256, help="8B workloads' N")
    parser.add_argument("--small-num-prompts", type=int, default=256)
    parser.add_argument("--small-model", default=None,
                        help="the small part's model (the bundled SmolLM2 GGUF's path); "
                             "default: random weights of its shape")
    parser.add_argument("--decode-output-len", type=int, default=1024)
    parser.add_argument("--attention-backend", default="TRITON",
                        help="TRITON compiles in seconds; FLASHINFER JITs ~90 s per head size "
                             "on a fresh machine")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="e.g. tq_4bit with --attention-backend TURBOQUANT (its decode "
                             "steps replay CUDA graphs too)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.75,
                        help="8B engine; leaves room for transformers on the same weights")
    parser.add_argument("--enforce-eager", action="store_true", help="8B engine without graphs")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="the engines schedule step N+1 while step N runs "
                        "(default: the engine's, on for CUDA)")
    parser.add_argument("--busy-contexts", default="1024",
                        help="prompt lengths of the engine's decode-step measurements")
    parser.add_argument("--hf-num-prompts", type=int, default=64)
    parser.add_argument("--hf-max-output-len", type=int, default=256,
                        help="transformers' generated tokens are capped at this (time)")
    for part in ("small", "8b", "hf", "prefill-heavy", "decode-heavy", "step-time", "busy"):
        parser.add_argument(f"--skip-{part}", action="store_true")
    args = parser.parse_args()
    print(f"settings: {vars(args)}", flush=True)
    t0 = time.perf_counter()
    rates = measure_rates()
    row("bf16 matmul rate", f"{rates[0] / 1e12:.0f} TFLOP/s")
    row("device copy bandwidth", f"{rates[1] / 1e12:.2f} TB/s")
    for name, part, skip in (("small model", small_model, args.skip_small),
                             ("8B model", lambda a: big_model(a, rates), args.skip_8b)):
        if skip:
            continue
        try:
            part(args)
        except Exception as exc:  # one part failing must not lose the others' figures
            import traceback

            traceback.print_exc()
            row(f"{name}", f"FAILED: {type(exc).__name__}: {exc}")
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n== summary ({time.perf_counter() - t0:.0f} s)")
    width = max(len(w) for w, _, _ in ROWS)
    for what, measured, ref in ROWS:
        print(f"{what:<{width}}  {measured}  {ref}")


if __name__ == "__main__":
    main()
