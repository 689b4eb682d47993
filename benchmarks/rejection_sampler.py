"""The rejection sampler's torch path against its Triton kernel on CUDA, side by side:

    python benchmarks/rejection_sampler.py [--batch-sizes 1,4,16,64,256] [--ks 1,2,3,4]
        [--vocab 128256] [--modes greedy,ngram,probs] [--iters 30] [--json FILE]
    python benchmarks/rejection_sampler.py --smoke   # tiny shapes on the CPU, Triton's
                                                     # interpreter: the check alone, no times
    python benchmarks/rejection_sampler.py --compile 90 [--triton-path DIR]
        # no GPU needed: compiles the kernel's variants for sm_90 with that triton (the
        # device's may be older than this machine's)

Every request of a row has K drafts, each the target's argmax at its position 70% of the time
(else a random token), so walks stop at every depth. Modes: `greedy` (temperature 0), `ngram`
(temperature 1, drafts without probabilities: one-hot q), `probs` (temperature 1, a draft
model's distributions [B, K, V]). Two figures per path, CUDA events, median of `--iters`:
- `walk`: what the kernel replaces, from the processed target (argmax, probabilities) and the
  step's draws to the [B, K+1] tokens: torch's acceptance and output assembly with the
  residual / bonus sample, against the one kernel launch;
- `call`: the whole sampler call (the target's processing and the draws included, the same in
  both paths).
Each row also checks that both paths give the same tokens for the same draws.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
if "--compile" in sys.argv:  # a real compile, with the triton asked for
    os.environ.pop("TRITON_INTERPRET", None)
    if "--triton-path" in sys.argv:
        sys.path.insert(0, sys.argv[sys.argv.index("--triton-path") + 1])

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.engine.sampler import SamplingMetadata  # noqa: E402
from pagedserve.spec_decode.rejection_kernels import rejection_tokens_triton  # noqa: E402
from pagedserve.spec_decode.rejection_sampler import RejectionSampler  # noqa: E402
from pagedserve.spec_decode.verify import VerifyLayout, build_layout  # noqa: E402


def time_us(fn: Callable[[], object], iters: int, warmup: int = 3) -> float | None:
    if not iters:  # --smoke: no timing on the CPU
        return None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def make_step(b: int, k: int, vocab: int, mode: str, device: torch.device) -> tuple:
    """Logits, metadata, layout and draft probabilities of one verify step."""
    gen = torch.Generator(device).manual_seed(b * 10 + k)
    logits = torch.randn(b * (k + 1), vocab, device=device, generator=gen) * 3
    argmax = logits.argmax(-1).view(b, k + 1)[:, :k]
    other = torch.randint(0, vocab, (b, k), device=device, generator=gen)
    keep = torch.rand(b, k, device=device, generator=gen) < 0.7
    drafts = torch.where(keep, argmax, other).tolist()
    num = np.full(b, k, dtype=np.int64)
    layout = build_layout(num, drafts, np.arange(b + 1) * (k + 1), device)
    params = SamplingParams(temperature=0 if mode == "greedy" else 1.0)
    meta = SamplingMetadata.build([params] * b, [[]] * b, [[]] * b, {}, None, vocab, device)
    draft_probs = None
    if mode == "probs":
        near = logits.view(b, k + 1, vocab)[:, :k]
        draft_probs = (near + torch.randn(b, k, vocab, device=device, generator=gen)).softmax(-1)
    return logits, meta, layout, draft_probs


def walk_inputs(sampler: RejectionSampler, logits: torch.Tensor, meta: SamplingMetadata,
                layout: VerifyLayout) -> tuple:
    """The processed target and the draws, as the sampler computes them before the walk."""
    argmax, probs = sampler._target(logits, meta, layout)
    uniforms, noise = sampler._draws(probs, meta, layout)
    return argmax, probs, uniforms, noise


def run_row(b: int, k: int, vocab: int, mode: str, iters: int, device: torch.device) -> dict:
    logits, meta, layout, draft_probs = make_step(b, k, vocab, mode, device)
    torch_path, kernel = RejectionSampler(use_kernel=False), RejectionSampler(use_kernel=True)
    argmax, probs, uniforms, noise = walk_inputs(torch_path, logits, meta, layout)
    num_drafts = torch.from_numpy(layout.num_drafts).to(device)

    def walk_torch():
        accepted = torch_path._accepted(argmax, probs, meta, layout, draft_probs, uniforms)
        return torch_path._tokens(accepted, argmax, probs, meta, layout, draft_probs, noise)

    def walk_kernel():
        return rejection_tokens_triton(argmax, probs, num_drafts, layout.row_start_dev,
                                       layout.drafts_dev, meta.is_greedy, draft_probs,
                                       uniforms, noise)

    same = torch.equal(walk_torch(), walk_kernel())
    kept = float(((walk_kernel() >= 0).sum(1) - 1).float().mean())
    return {
        "mode": mode, "batch": b, "k": k, "vocab": vocab, "same_tokens": same,
        "mean_kept": round(kept, 2),
        "walk_torch_us": time_us(walk_torch, iters), "walk_triton_us": time_us(walk_kernel, iters),
        "call_torch_us": time_us(lambda: torch_path(logits, meta, layout, draft_probs), iters),
        "call_triton_us": time_us(lambda: kernel(logits, meta, layout, draft_probs), iters),
    }


def compile_variants(arch: int) -> None:
    """Compile every variant a launch can ask for (all greedy, random with and without draft
    probabilities, K of 1 to 8) for sm_`arch` and print their cubin sizes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedserve.spec_decode import rejection_kernels as rk

    ints = ("vocab_size", "kmax", "dp_stride_b", "dp_stride_k", "noise_stride")
    ptrs = {"tokens_ptr": "*i64", "num_drafts_ptr": "*i64", "row_start_ptr": "*i64",
            "drafts_ptr": "*i64", "argmax_ptr": "*i64", "is_greedy_ptr": "*i1"}
    print(f"triton {triton.__version__}, target sm_{arch}")
    for all_greedy, with_q in ((True, False), (False, False), (False, True)):
        floats = "*i64" if all_greedy else "*fp32"  # an all-greedy launch passes argmax
        sig = {**ptrs, "probs_ptr": floats, "draft_probs_ptr": "*fp32" if with_q else "*i64",
               "uniforms_ptr": floats, "noise_ptr": floats, **dict.fromkeys(ints, "i32"),
               **dict.fromkeys(("ALL_GREEDY", "HAS_DRAFT_PROBS", "KBLOCK", "BLOCK"),
                               "constexpr")}
        for kblock in (1, 2, 4, 8):
            consts = {"ALL_GREEDY": all_greedy, "HAS_DRAFT_PROBS": with_q, "KBLOCK": kblock,
                      "BLOCK": rk.BLOCK_V}
            compiled = triton.compile(
                ASTSource(rk._rejection_kernel, sig, constexprs=consts),
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": 1 if all_greedy else 8})
            print(f"all_greedy={all_greedy!s:5} draft_probs={with_q!s:5} KBLOCK={kblock}: "
                  f"{len(compiled.asm['cubin'])} bytes of cubin")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,4,16,64,256")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--modes", default="greedy,ngram,probs")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--smoke", action="store_true",
                    help="B 1,3 / K 0..2 / V 64 on the CPU in the interpreter, no timing")
    ap.add_argument("--compile", type=int, metavar="ARCH",
                    help="compile the kernel for sm_ARCH without a GPU, then stop")
    ap.add_argument("--triton-path", help="with --compile: a directory holding that triton")
    args = ap.parse_args()
    if args.compile:
        compile_variants(args.compile)
        return
    if args.smoke:
        device = torch.device("cpu")
        args.batch_sizes, args.ks, args.vocab, args.iters = "1,3", "0,1,2", 64, 0
    elif not torch.cuda.is_available():
        raise SystemExit("rejection_sampler.py times CUDA kernels: no CUDA device here "
                         "(--smoke checks the paths on the CPU)")
    else:
        device = torch.device("cuda")
        print(f"{torch.cuda.get_device_name()}, V={args.vocab}, median of {args.iters}")
    times = "" if args.smoke else (f" {'walk torch':>11} {'triton':>8} {'x':>5} "
                                   f"{'call torch':>11} {'triton':>8} {'x':>5}")
    print(f"{'mode':6} {'B':>4} {'K':>2} {'kept':>5}{times}  same")
    rows = []
    for mode in args.modes.split(","):
        for b in map(int, args.batch_sizes.split(",")):
            for k in map(int, args.ks.split(",")):
                r = run_row(b, k, args.vocab, mode, args.iters, device)
                rows.append(r)
                if args.smoke:
                    print(f"{mode:6} {b:>4} {k:>2} {r['mean_kept']:>5.2f}  {r['same_tokens']}")
                    continue
                print(f"{mode:6} {b:>4} {k:>2} {r['mean_kept']:>5.2f} "
                      f"{r['walk_torch_us']:>9.1f}us {r['walk_triton_us']:>6.1f}us "
                      f"{r['walk_torch_us'] / r['walk_triton_us']:>5.1f} "
                      f"{r['call_torch_us']:>9.1f}us {r['call_triton_us']:>6.1f}us "
                      f"{r['call_torch_us'] / r['call_triton_us']:>5.2f}  {r['same_tokens']}",
                      flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("the kernel's tokens differ from the torch path's in some row")


if __name__ == "__main__":
    main()
