"""The cost of guided decoding: decode throughput of a batch whose every request follows a JSON
schema against the same batch unguided, and the per-step bitmask time.

Each request generates exactly --output-len tokens either way (unguided: ignore_eos; guided: a
schema of at least 64 objects of several typed fields, which cannot close sooner), so both runs
take the same steps at the same batch size and the throughput ratio is the grammar's cost: the
bitmask fill on the host (xgrammar's batch matcher), its application (on CUDA one kernel that
reads the host mask), the matchers' token acceptance (guided requests keep async scheduling).
Runs alternate unguided / guided --repeats times.

    python benchmarks/structured_output.py [--device cpu|cuda] [--batch 64] [--output-len 32]
        [--repeats 2] [--threads N] [--no-seed] [--model random:smollm2-135m --tokenizer DIR]
        [--guided-decoding-workers N] [--guided-fraction F]

--guided-fraction F: a guided run's first F of the requests follow the schema, the others
not (a mixed batch: on CUDA the rows without a grammar then allow every token in the mask).
--no-seed samples without per-request seeds (a seeded request draws from its own generator,
row by row, a cost both runs share that dilutes the grammar's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.structured_output.manager import resolve_workers

ITEM = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
                       "unit": {"enum": ["g", "kg", "ml", "l"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                "maxItems": 3}},
        "required": ["name", "qty", "unit", "tags"], "additionalProperties": False}
SCHEMA = {"type": "array", "minItems": 64, "items": ITEM}
PROMPT = "List the ingredients of a cake as JSON:"


def run(llm: LLM, batch: int, output_len: int, guided: bool,
        seeded: bool = True, fraction: float = 1.0) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, tokens generated). `fraction`: of a guided
    run's requests, the share that follows the schema (the first ones)."""
    num_guided = round(batch * fraction) if guided else 0
    g = GuidedDecodingParams(json=SCHEMA)
    cuda = llm.engine.config.torch_device.type == "cuda"
    params = [SamplingParams(temperature=0.8, seed=i if seeded else None, max_tokens=output_len,
                             ignore_eos=True, guided_decoding=g if i < num_guided else None)
              for i in range(batch)]
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == batch * output_len, "a request ended early: the comparison is off"
    return elapsed, cpu, tokens


def apply_time(device: torch.device, batch: int, vocab: int, iters: int = 50) -> float:
    """Median seconds of the sampler's masked copy of [batch, vocab] float32 logits, every row
    guided (on CUDA the mask in pinned host memory, as the engine hands it over)."""
    from pagedserve.structured_output.manager import masked_logits

    logits = torch.randn(batch, vocab, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, -(-vocab // 32)), dtype=torch.int32)
    if device.type == "cuda":
        bitmask = bitmask.pin_memory()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        masked_logits(logits, bitmask, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--model", default=None, help="model path (default: the bundled GGUF)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer path (a random:<shape> model has none of its own)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-seed", action="store_true")
    parser.add_argument("--guided-fraction", type=float, default=1.0,
                        help="share of a guided run's requests that follow the schema (a "
                             "mixed batch: the others unguided)")
    parser.add_argument("--engine-core-process", action="store_true",
                        help="the engine core in its own process, as the CLI runs it on CUDA "
                             "(the per-step fill times are then not reported)")
    parser.add_argument("--async-scheduling", action="store_true", default=None,
                        help="async scheduling on the CPU too (CUDA's default)")
    parser.add_argument("--guided-decoding-workers", type=int, default=None,
                        help="grammar worker processes (default: the engine's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, tokenizer=args.tokenizer, device=args.device,
              max_num_seqs=args.batch, kv_cache_memory="512MiB",
              engine_core_process=args.engine_core_process or None,
              async_scheduling=args.async_scheduling,
              guided_decoding_workers=args.guided_decoding_workers)
    manager = llm.engine.structured_output
    # Compile the grammar and warm both paths up at the full batch size (the first run of a
    # shape is slower, and would otherwise count against whichever goes first).
    run(llm, args.batch, 2, guided=True)
    run(llm, args.batch, 2, guided=False)
    # Throughput by wall time, and by this process's CPU time (steadier on a shared CPU
    # machine, where neighbours take cores; meaningless on CUDA, where the host waits).
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu_rates: dict[bool, list[float]] = {False: [], True: []}
    fill_s = wait_s = fills = 0.0
    for _ in range(args.repeats):
        for guided in (False, True):
            before = (manager.fill_seconds, manager.wait_seconds, manager.num_fills)
            elapsed, cpu, tokens = run(llm, args.batch, args.output_len, guided,
                                       seeded=not args.no_seed, fraction=args.guided_fraction)
            rates[guided].append(tokens / elapsed)
            cpu_rates[guided].append(tokens / cpu)
            if guided:
                fill_s += manager.fill_seconds - before[0]
                wait_s += manager.wait_seconds - before[1]
                fills += manager.num_fills - before[2]
    plain, guided = statistics.median(rates[False]), statistics.median(rates[True])
    device = llm.engine.config.torch_device
    # The manager here is the front's when the core runs in its own process: the core's
    # workers follow the same rule.
    workers = resolve_workers(args.guided_decoding_workers, device)
    print(f"device {device}, batch {args.batch}, {args.output_len} output tokens, "
          f"{args.repeats} repeats, {'unseeded' if args.no_seed else 'seeded'}, "
          f"{workers} grammar workers, guided runs {args.guided_fraction:.0%} guided")
    print(f"unguided: {plain:.1f} tok/s (runs: {', '.join(f'{r:.1f}' for r in rates[False])})")
    print(f"guided:   {guided:.1f} tok/s (runs: {', '.join(f'{r:.1f}' for r in rates[True])})")
    # Each repeat's guided run against the unguided run just before it: the host's speed
    # drifts within a process (unguided runs of one process 25-41k tok/s on the H200).
    pairs = [g / u for g, u in zip(rates[True], rates[False], strict=True)]
    print(f"guided / unguided, run by run: {', '.join(f'{r:.3f}' for r in pairs)} "
          f"(median {statistics.median(pairs):.3f})")
    print(f"guided / unguided: {guided / plain:.3f} by wall time, "
          f"{statistics.median(cpu_rates[True]) / statistics.median(cpu_rates[False]):.3f} "
          f"by this process's CPU time" + (" (the workers' not counted)" if workers else ""))
    if args.engine_core_process:
        print("bitmask fill per step: in the engine core's process, not timed here")
    else:
        where = "in the slowest worker" if workers else "on the fill thread"
        print(f"bitmask fill per step: {1e3 * fill_s / max(fills, 1):.3f} ms {where}; "
              f"the engine thread's wait for it and its copy: "
              f"{1e3 * wait_s / max(fills, 1):.3f} ms ({int(fills)} steps)")
    vocab = llm.engine.vocab_size
    print(f"bitmask apply per step [{args.batch} x {vocab}]: "
          f"{1e3 * apply_time(device, args.batch, vocab):.3f} ms")


if __name__ == "__main__":
    main()
