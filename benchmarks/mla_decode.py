"""Time MLA decode (TRITON_MLA's kernel, ops/mla_decode.py, and FLASHINFER_MLA's FlashInfer
wrapper where available) on DeepSeek's decode shape and report the fraction of HBM bandwidth
each reaches on the latent cache.

Default workload: 64 sequences x 4,096 context, 128 heads, latent 512 + rope 64, bf16, page 64.
Bytes = sequences x context x (L + R) x element size (each latent row read once; the queries
and the output are small beside it), against --peak-tbs (4.8 TB/s, the H200's HBM3e) and
against the device-to-device copy rate measured first (`copy`: bytes read + written of a
cache-sized copy per second). TFLOP/s counts the absorbed form's dots, 2 x (L + R + L) per key
and head: at 128 heads that is ~240 FLOP per cache byte, above the H200's bf16 ridge (~206),
so a 128-head decode is bound by its tensor cores before HBM (all 989 dense TFLOP/s would be
85% of 4.8 TB/s). Rows: `kernel` (the attention launch alone, every key from the pages),
`forward` (the impl as the model runs it: q_nope @ W_UK, the latent write, the kernel,
out @ W_UV), for TRITON_MLA and then FLASHINFER_MLA (its `kernel` row: the planned wrapper's
run alone; the plan, host work once per step, is timed apart).

--sweep times every launch shape of `sweep_tiles()` for the head count (or --configs) on the
same data and prints one table, fastest first: each shape's time, % of peak and of the copy
rate, TFLOP/s and its largest difference from a float32 reference; shapes that do not compile
(shared memory) are listed as failed. The winner goes into ops/mla_decode.py's defaults by hand.
Tile strings: block_h/block_q/block_n/num_warps/num_stages/num_splits/lazy_rescale.

    python benchmarks/mla_decode.py [--seqs 64] [--context 4096] [--heads 128] [--sweep]
        [--configs 64/1/32/8/3/1/1,64/1/64/8/2/1/0] [--block-size 16]
    TRITON_INTERPRET=1 python benchmarks/mla_decode.py --device cpu --seqs 2 --context 64 \
        --heads 4 --lora 32 --rope 8 --nope 16 --v 12 --iters 1 --sweep \
        --configs 16/1/16/4/1/1/1,16/1/16/4/1/2/0   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernels import time_cuda  # noqa: E402

from pagedserve.attention.backend import BuilderConfig  # noqa: E402
from pagedserve.attention.backends.triton_mla import TritonMLABackend  # noqa: E402
from pagedserve.attention.metadata import CommonMetadataBuilder  # noqa: E402
from pagedserve.attention.mla import MLALayerConfig  # noqa: E402
from pagedserve.attention.ops.mla_decode import MLATiles, mla_attention  # noqa: E402


def sweep_tiles(num_heads: int = 128) -> list[MLATiles]:
    """The launch shapes to time: the small-head grid below 64 heads, else the 128-head one."""
    return small_head_tiles() if num_heads < 64 else large_head_tiles()


def small_head_tiles() -> list[MLATiles]:
    """Below 64 heads (DeepSeek's 128 split over 8 or 4 GPUs: 16 or 32): one head block per
    request, so a step has few programs and is bound by how many key tiles are in flight. 48
    shapes: 16-64 key tiles (shared memory for two or three programs an SM at 16-32), 4 or 8
    warps, 2 or 3 stages, the keys split 1-8 ways."""
    return [MLATiles(16, 1, n, w, st, sp, False)
            for n, w, st, sp in itertools.product([16, 32, 64], [4, 8], [2, 3], [1, 2, 4, 8])]


def large_head_tiles() -> list[MLATiles]:
    """The H200 grid, 42 shapes. 64 heads per program (the 128 KB fp32 accumulator): 8 warps
    with 16-64 key tiles, 2 or 3 stages (sm_90a compiles keep two key buffers at 3 and 4
    stages: the third stage fetches page ids earlier), unsplit or split, lazy rescaling on and
    off; 16 warps (128 registers a thread: they spill); 32 heads per program (rows read four
    times, from L2; 2 programs per SM on 4 warps)."""
    grid = [MLATiles(64, 1, n, 8, st, sp, lazy)
            for n, st, sp, lazy in itertools.product([16, 32, 64], [2, 3], [1, 2], [True, False])]
    grid += [MLATiles(64, 1, 32, 8, 3, sp, True) for sp in (3, 4)]
    grid += [MLATiles(64, 1, n, 16, st, 1, True)
             for n, st in itertools.product([16, 32, 64], [2, 3])]
    grid += [MLATiles(32, 1, n, w, st, 1, True)
             for n, w, st in itertools.product([32, 64], [4, 8], [2, 3])]
    grid += [MLATiles(64, 1, n, 8, 4, 1, True) for n in (16, 32)]
    return grid


# The launch shape measured at 454.5 us (13.8% of peak) on 2026-12-01, for comparison.
OLD_DEFAULT = MLATiles(64, 1, 32, 8, 2, 1, False)


def parse_tiles(text: str) -> MLATiles:
    """block_h/block_q/block_n/num_warps/num_stages[/num_splits[/lazy_rescale]]"""
    values = [int(v) for v in text.split("/")]
    if len(values) > 6:
        values[6] = bool(values[6])
    return MLATiles(*values)


def tiles_label(t: MLATiles) -> str:
    return (f"h{t.block_h} n{t.block_n} w{t.num_warps} st{t.num_stages} sp{t.num_splits}"
            f"{' lazy' if t.lazy_rescale else ''}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--lora", type=int, default=512, help="kv_lora_rank")
    p.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    p.add_argument("--nope", type=int, default=128, help="qk_nope_head_dim")
    p.add_argument("--v", type=int, default=128, help="v_head_dim")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--peak-tbs", type=float, default=4.8, help="HBM peak, TB/s")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler table of TRITON_MLA's eager forward (host vs device)")
    p.add_argument("--sweep", action="store_true",
                   help="time every launch shape of sweep_tiles() (or --configs)")
    p.add_argument("--configs", default=None,
                   help="comma-separated tile strings for --sweep instead of its grid")
    p.add_argument("--flashinfer-kernels", default="fa2,fa3",
                   help="FlashInfer MLA kernel families to time beside its auto choice")
    p.add_argument("--backends", default="TRITON_MLA,FLASHINFER_MLA",
                   help="comma-separated; unavailable ones are skipped with the reason")
    return p.parse_args()


class Decode:
    """A decode step of `seqs` requests at `context` tokens (the last one new), pages shuffled,
    with the TRITON_MLA impl bound to random weights."""

    def __init__(self, args: argparse.Namespace) -> None:
        dev, dtype, bs = torch.device(args.device), getattr(torch, args.dtype), args.block_size
        self.layer = MLALayerConfig(args.heads, 1, args.lora + args.rope, dtype,
                                    scale=(args.nope + args.rope) ** -0.5,
                                    kv_lora_rank=args.lora, qk_nope_head_dim=args.nope,
                                    qk_rope_head_dim=args.rope, v_head_dim=args.v)
        pages = -(-args.context // bs)
        num_blocks = args.seqs * pages
        table = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
        table = table.reshape(args.seqs, pages)
        self.kv_cache = torch.randn(num_blocks, bs, args.lora + args.rope, device=dev,
                                    dtype=dtype)
        builder = CommonMetadataBuilder(args.seqs, args.seqs, pages, bs, dev)
        self.common = builder.build(np.arange(args.seqs),
                                    np.full(args.seqs, args.context - 1, np.int32),
                                    np.ones(args.seqs, np.int32), 0, table)
        config = BuilderConfig.for_layer(self.layer, bs, args.seqs, args.seqs, pages, dev)
        self.metadata = TritonMLABackend.get_builder_cls()(config).build(self.common)
        self.impl = TritonMLABackend.get_impl_cls()(self.layer)
        self.impl.bind_kv_b_proj(torch.randn(args.heads * (args.nope + args.v), args.lora,
                                             device=dev, dtype=dtype) / args.lora ** 0.5)
        self.query = torch.randn(args.seqs, args.heads, args.nope + args.rope, device=dev,
                                 dtype=dtype)
        self.latent = torch.randn(args.seqs, 1, args.lora + args.rope, device=dev, dtype=dtype)
        self.q_lat = torch.randn(args.seqs, args.heads, args.lora, device=dev, dtype=dtype)
        self.out_lat = torch.empty_like(self.q_lat)

    def kernel(self, tiles: MLATiles) -> None:
        md, c = self.metadata, self.common
        mla_attention(self.q_lat, self.query[..., self.layer.qk_nope_head_dim:], self.kv_cache,
                      self.out_lat, c.block_table, c.query_start_loc, c.seq_lens,
                      md.qblock_req, md.qblock_start, md.num_qblocks, self.impl.scale, tiles)

    def forward(self) -> None:
        self.impl.forward(self.query, self.latent, None, self.kv_cache, self.metadata)

    def reference(self) -> torch.Tensor:
        """The kernel's latent output in float32 torch, a sequence at a time (the whole batch
        at once would hold seqs x heads x context scores)."""
        c, lora = self.common, self.layer.kv_lora_rank
        q_pe = self.query[..., self.layer.qk_nope_head_dim:].float()
        out = torch.empty(self.q_lat.shape, dtype=torch.float32, device=self.q_lat.device)
        seq_lens = c.seq_lens_cpu
        for i in range(len(seq_lens)):
            n = int(seq_lens[i])
            pages = c.block_table[i, :-(-n // self.kv_cache.shape[1])].long()
            rows = self.kv_cache[pages].flatten(0, 1)[:n].float()
            scores = (self.q_lat[i].float() @ rows[:, :lora].T
                      + q_pe[i] @ rows[:, lora:].T) * self.impl.scale
            out[i] = torch.softmax(scores, dim=-1) @ rows[:, :lora]
        return out


class FlashInferDecode:
    """FLASHINFER_MLA on the same step, cache and weights as a `Decode`."""

    def __init__(self, step: Decode, args: argparse.Namespace) -> None:
        from pagedserve.attention.backends.flashinfer_mla import FlashInferMLABackend

        dev, bs = torch.device(args.device), args.block_size
        pages = -(-args.context // bs)
        config = BuilderConfig.for_layer(step.layer, bs, args.seqs, args.seqs, pages, dev)
        self.step = step
        self.builder = FlashInferMLABackend.get_builder_cls()(config)
        self.metadata = self.builder.build(step.common)
        self.impl = FlashInferMLABackend.get_impl_cls()(step.layer)
        self.impl.bind_kv_b_proj(step.impl._kv_b_proj)
        self.q_pe = step.query[..., step.layer.qk_nope_head_dim:]

    def kernel(self) -> None:
        self.metadata.wrapper.run(query=(self.step.q_lat, self.q_pe),
                                  kv_cache=self.step.kv_cache, out=self.step.out_lat)

    def plan(self) -> None:
        self.builder.build(self.step.common)

    def forward(self) -> None:
        s = self.step
        self.impl.forward(s.query, s.latent, None, s.kv_cache, self.metadata)


class Rates:
    """What a time means for this workload: cache bytes over seconds against the HBM peak and
    the measured copy rate, and the absorbed dots' FLOP/s."""

    def __init__(self, args: argparse.Namespace, cache_bytes: int, copy_tbs: float) -> None:
        self.cache_bytes, self.peak_tbs, self.copy_tbs = cache_bytes, args.peak_tbs, copy_tbs
        self.flops = 2 * args.seqs * args.context * args.heads * (2 * args.lora + args.rope)

    def columns(self, seconds: float) -> str:
        tbs = self.cache_bytes / seconds / 1e12
        copy = f"{tbs / self.copy_tbs:6.1%}" if self.copy_tbs else "     -"
        return (f"{seconds * 1e6:9.1f} us  {tbs:6.2f} TB/s  {tbs / self.peak_tbs:6.1%} of peak"
                f"  {copy} of copy  {self.flops / seconds / 1e12:6.1f} TFLOP/s")


def report(name: str, seconds: float, rates: Rates) -> None:
    print(f"{name:<50} {rates.columns(seconds)}")


def copy_rate(nbytes: int, device: torch.device, args: argparse.Namespace) -> float:
    """TB/s of a device-to-device copy of `nbytes` (read + written), 0 off CUDA."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), args.warmup, args.iters)
    return 2 * nbytes / seconds / 1e12


def sweep(step: Decode, args: argparse.Namespace, rates: Rates) -> None:
    expected = step.reference()
    configs = ([parse_tiles(t) for t in args.configs.split(",")] if args.configs
               else sweep_tiles(args.heads))
    print(f"sweep: {len(configs)} launch shapes (block_h/block_n/warps/stages/splits/lazy)")
    results, failed = [], []
    for tiles in configs:
        step.out_lat.fill_(float("nan"))
        try:
            seconds = time_cuda(lambda t=tiles: step.kernel(t), args.warmup, args.iters)
        except Exception as exc:  # shared memory or registers out of range: skip the shape
            failed.append(f"{tiles_label(tiles)}: {type(exc).__name__}")
            continue
        err = (step.out_lat.float() - expected).abs().max().item()
        results.append((seconds, tiles, err))
    default = step.metadata.tiles
    print(f"{'config':<36} time, rate, of HBM peak, of the copy rate, TFLOP/s, max abs diff "
          "from float32")
    for seconds, tiles, err in sorted(results, key=lambda r: r[0]):
        mark = (" (default)" if tiles == default
                else " (old default shape)" if tiles == OLD_DEFAULT else "")
        print(f"{tiles_label(tiles) + mark:<36} {rates.columns(seconds)}  {err:.1e}")
    for line in failed:
        print(f"failed: {line}")


def profile_forward(forward, iters: int) -> None:
    """Each op's host time against its device time over `iters` eager forwards: a forward row
    far above its kernel row is the host issuing launches slower than the GPU runs them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            forward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14,
                                    max_name_column_width=48))


def main() -> None:
    args = parse_args()
    step = Decode(args)
    cache_bytes = args.seqs * args.context * (args.lora + args.rope) * step.kv_cache.element_size()
    rates = Rates(args, cache_bytes, copy_rate(cache_bytes, torch.device(args.device), args))
    print(f"decode {args.seqs} x {args.context}, {args.heads} heads, latent {args.lora} + "
          f"{args.rope}, {args.dtype}, page {args.block_size}: {cache_bytes / 2**20:.0f} MiB "
          f"of latent cache; copy rate {rates.copy_tbs:.2f} TB/s; default tiles "
          f"{tiles_label(step.metadata.tiles)}")
    backends = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    if "TRITON_MLA" in backends:
        seconds = time_cuda(lambda: step.kernel(step.metadata.tiles), args.warmup, args.iters)
        report("TRITON_MLA kernel", seconds, rates)
        err = (step.out_lat.float() - step.reference()).abs().max().item()
        print(f"{'':<50} max abs diff from the float32 reference: {err:.2e}")
        seconds = time_cuda(step.forward, args.warmup, args.iters)
        report("TRITON_MLA forward (bmm + write + kernel + bmm)", seconds, rates)
        if args.profile:
            profile_forward(step.forward, args.iters)
        triton_out = step.out_lat.clone()
        if args.sweep:
            sweep(step, args, rates)
    if "FLASHINFER_MLA" in backends:
        from pagedserve.attention.backends.flashinfer_mla import FlashInferMLABackend

        ok, why = FlashInferMLABackend.is_available()
        if not ok:
            print(f"FLASHINFER_MLA skipped: {why}")
            return
        for kind in args.flashinfer_kernels.split(","):
            builder_cls = FlashInferMLABackend.get_builder_cls()
            builder_cls.kernel_backend = kind
            try:
                fi = FlashInferDecode(step, args)
                seconds = time_cuda(fi.kernel, args.warmup, args.iters)
            except Exception as exc:  # a kernel family this FlashInfer or GPU does not build
                print(f"FLASHINFER_MLA kernel ({kind}): failed ({type(exc).__name__}: {exc})")
                continue
            report(f"FLASHINFER_MLA kernel (wrapper.run, {kind})", seconds, rates)
        builder_cls.kernel_backend = "auto"
        fi = FlashInferDecode(step, args)
        seconds = time_cuda(fi.kernel, args.warmup, args.iters)
        report("FLASHINFER_MLA kernel (wrapper.run)", seconds, rates)
        if "TRITON_MLA" in backends:
            err = (step.out_lat.float() - triton_out.float()).abs().max().item()
            print(f"{'':<50} max abs diff of the two kernels' latent outputs: {err:.2e}")
        seconds = time_cuda(fi.forward, args.warmup, args.iters)
        report("FLASHINFER_MLA forward (bmm + write + run + bmm)", seconds, rates)
        start = time.perf_counter()
        for _ in range(args.iters):
            fi.plan()
        torch.cuda.synchronize()
        print(f"{'FLASHINFER_MLA plan (host, per step)':<50} "
              f"{(time.perf_counter() - start) / args.iters * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
