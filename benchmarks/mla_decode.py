"""Time MLA decode (TRITON_MLA's kernel, ops/mla_decode.py, and FLASHINFER_MLA's FlashInfer
wrapper where available) on DeepSeek's decode shape and report the fraction of HBM bandwidth
each reaches on the latent cache.

Default workload: 64 sequences x 4,096 context, 128 heads, latent 512 + rope 64, bf16, page 64.
Bytes = sequences x context x (L + R) x element size (each latent row read once; the queries
and the output are small beside it), against --peak-tbs (4.8 TB/s, the H200's HBM3e). Rows:
`kernel` (the attention launch alone, every key from the pages), `forward` (the impl as the
model runs it: q_nope @ W_UK, the latent write, the kernel, out @ W_UV), for TRITON_MLA and
then FLASHINFER_MLA (its `kernel` row: the planned wrapper's run alone; the plan, host work
once per step, is timed apart). --sweep also times
every launch shape of the grid below on the same data, checks each against the default's
output and prints the fastest; the winner goes into ops/mla_decode.py by hand.

    python benchmarks/mla_decode.py [--seqs 64] [--context 4096] [--heads 128] [--sweep]
    TRITON_INTERPRET=1 python benchmarks/mla_decode.py --device cpu --seqs 2 --context 64 \
        --heads 4 --lora 32 --rope 8 --nope 16 --v 12 --iters 1   # smoke run, no GPU
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

SWEEP = dict(block_h=[32, 64], block_q=[1], block_n=[16, 32, 64], num_warps=[4, 8],
             num_stages=[1, 2], num_splits=[1, 2, 4])


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
    p.add_argument("--sweep", action="store_true", help="time every launch shape in SWEEP")
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


def report(name: str, seconds: float, cache_bytes: int, peak_tbs: float) -> None:
    tbs = cache_bytes / seconds / 1e12
    print(f"{name:<50} {seconds * 1e6:9.1f} us  {tbs:6.2f} TB/s  {tbs / peak_tbs:6.1%} of peak")


def sweep(step: Decode, args: argparse.Namespace, cache_bytes: int) -> None:
    step.kernel(step.metadata.tiles)
    expected = step.out_lat.clone()
    results = []
    for values in itertools.product(*SWEEP.values()):
        tiles = MLATiles(*values)
        try:
            seconds = time_cuda(lambda t=tiles: step.kernel(t), args.warmup, args.iters)
        except Exception as exc:  # shared memory or registers out of range: skip the shape
            print(f"{tiles}: failed ({type(exc).__name__})")
            continue
        err = (step.out_lat.float() - expected.float()).abs().max().item()
        results.append((seconds, tiles, err))
    for seconds, tiles, err in sorted(results, key=lambda r: r[0])[:10]:
        report(f"h{tiles.block_h} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"
               f" splits{tiles.num_splits}"
               f" (err {err:.1e})", seconds, cache_bytes, args.peak_tbs)


def main() -> None:
    args = parse_args()
    step = Decode(args)
    cache_bytes = args.seqs * args.context * (args.lora + args.rope) * step.kv_cache.element_size()
    print(f"decode {args.seqs} x {args.context}, {args.heads} heads, latent {args.lora} + "
          f"{args.rope}, {args.dtype}, page {args.block_size}: {cache_bytes / 2**20:.0f} MiB "
          f"of latent cache; tiles {step.metadata.tiles}")
    backends = [b.strip().upper() for b in args.backends.split(",") if b.strip()]
    if "TRITON_MLA" in backends:
        seconds = time_cuda(lambda: step.kernel(step.metadata.tiles), args.warmup, args.iters)
        report("TRITON_MLA kernel", seconds, cache_bytes, args.peak_tbs)
        seconds = time_cuda(step.forward, args.warmup, args.iters)
        report("TRITON_MLA forward (bmm + write + kernel + bmm)", seconds, cache_bytes,
               args.peak_tbs)
        triton_out = step.out_lat.clone()
        if args.sweep:
            sweep(step, args, cache_bytes)
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
            report(f"FLASHINFER_MLA kernel (wrapper.run, {kind})", seconds, cache_bytes,
                   args.peak_tbs)
        builder_cls.kernel_backend = "auto"
        fi = FlashInferDecode(step, args)
        seconds = time_cuda(fi.kernel, args.warmup, args.iters)
        report("FLASHINFER_MLA kernel (wrapper.run)", seconds, cache_bytes, args.peak_tbs)
        if "TRITON_MLA" in backends:
            err = (step.out_lat.float() - triton_out.float()).abs().max().item()
            print(f"{'':<50} max abs diff of the two kernels' latent outputs: {err:.2e}")
        seconds = time_cuda(fi.forward, args.warmup, args.iters)
        report("FLASHINFER_MLA forward (bmm + write + run + bmm)", seconds, cache_bytes,
               args.peak_tbs)
        start = time.perf_counter()
        for _ in range(args.iters):
            fi.plan()
        torch.cuda.synchronize()
        print(f"{'FLASHINFER_MLA plan (host, per step)':<50} "
              f"{(time.perf_counter() - start) / args.iters * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
