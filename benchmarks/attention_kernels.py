"""Time paged attention on the GPU: a decode batch (default 64 sequences x 2,048 context) and a
causal prefill (default 8 x 2,048 new tokens), 32 query / 8 KV heads, head_dim 128, bf16, pages
of 16 with shuffled block ids. Reports decode KV bandwidth and prefill TFLOP/s next to the
device's measured copy bandwidth and bf16 matmul rate, for each attention backend named in
--backends (through the engine's builder + impl.forward) and, when flashinfer imports, for
FlashInfer's wrappers called directly on the same data.

    python benchmarks/attention_kernels.py [--backends TRITON,FLASHINFER,FLASH_ATTN]
        [--decode-tiles 16,64,4,3] [--prefill-tiles 128,64,8,3]   # block_m,block_n,warps,stages
        [--write]   # also time the ways to write a step's K/V into FlashInfer's NHD cache

FLEX_ATTENTION beside TRITON (compiled flex; the first call of each shape compiles):

    python benchmarks/attention_kernels.py \\
        --backends TRITON,FLEX_ATTENTION,FLEX_UNFOLDED,FLEX_PACKED,FLEX_GATHER

FLEX_ATTENTION is the backend as the engine runs it on CUDA (the cache itself as keys, each
request starting its own query tile, the query heads of a KV head folded into rows);
FLEX_UNFOLDED the same with flex's enable_gqa (a flex head per query head); FLEX_PACKED also
with packed query tiles (vLLM's layout: one tile may hold several requests); FLEX_GATHER the
keys gathered from the pages (the layout before issue #25). Each backend's host build (once
per step for all layers) is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig, get_backend_cls
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.engine.input_batch import BlockTable


@dataclass
class Workload:
    name: str  # "decode" or "prefill"
    context: int  # cached tokens per sequence before the step
    new: int  # new tokens per sequence this step
    seqs: int

    @property
    def seq_len(self) -> int:
        return self.context + self.new


@dataclass
class Row:
    impl: str
    workload: str
    us: float
    value: float  # TB/s for decode, TFLOP/s for prefill
    ceiling: float


def time_cuda(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median seconds of `fn` over `iters` runs (CUDA events), after `warmup` runs."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # --device cpu smoke run
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def time_graph(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median seconds of one replay of `fn` captured in a CUDA graph: the GPU time alone, as
    the engine's decode graphs run it, without the host's launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, warmup, iters)


def copy_bandwidth(warmup: int, iters: int) -> float:
    """TB/s of a 2 GiB device-to-device copy, counting the bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), warmup, iters)
    return 2 * src.numel() * src.element_size() / t / 1e12


def matmul_tflops(warmup: int, iters: int, n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = time_cuda(lambda: a @ b, warmup, iters)
    return 2 * n ** 3 / t / 1e12


def kv_bytes(w: Workload, args) -> int:
    return 2 * w.seqs * w.seq_len * args.kv_heads * args.head_dim * 2  # K and V, bf16


def attention_flops(w: Workload, args) -> float:
    """Two matmuls (QK^T, PV) over the (query, key) pairs the causal mask lets through."""
    pairs = sum(w.context + i + 1 for i in range(w.new)) * w.seqs
    return 4.0 * args.heads * args.head_dim * pairs


class Setup:
    """One workload's shared data: shuffled block table, metadata, queries and new K/V."""

    def __init__(self, w: Workload, args) -> None:
        bs, dev = args.block_size, torch.device(args.device)
        self.w = w
        pages = -(-w.seq_len // bs)
        self.num_blocks = w.seqs * pages + 1
        rng = np.random.default_rng(0)
        perm = rng.permutation(self.num_blocks)
        self.table = BlockTable(w.seqs, pages)
        for row in range(w.seqs):
            self.table.add_row(row, perm[row * pages:(row + 1) * pages].tolist())
        self.common_builder = CommonMetadataBuilder(w.seqs, w.seqs * w.new, pages, bs, dev)
        self.common = self.common_builder.build(
            np.arange(w.seqs), np.full(w.seqs, w.context, dtype=np.int32),
            np.full(w.seqs, w.new, dtype=np.int32), 0 if w.new == 1 else w.seqs, self.table.table)
        t = w.seqs * w.new
        gen = torch.Generator(device=dev).manual_seed(0)
        self.device = dev
        self.query = torch.randn(t, args.heads, args.head_dim, generator=gen, device=dev,
                                 dtype=torch.bfloat16)
        self.key = torch.randn(t, args.kv_heads, args.head_dim, generator=gen, device=dev,
                               dtype=torch.bfloat16)
        self.value = torch.randn_like(self.key)
        self.pages = pages
        # One cache content for every implementation (new tokens already in place), so their
        # outputs can be compared.
        cache_shape = (self.num_blocks, bs, args.kv_heads, args.head_dim)
        self.k_cache = torch.randn(cache_shape, generator=gen, device=dev, dtype=torch.bfloat16)
        self.v_cache = torch.randn_like(self.k_cache)
        slots = self.common.slot_mapping
        self.k_cache.view(-1, args.kv_heads, args.head_dim)[slots] = self.key
        self.v_cache.view(-1, args.kv_heads, args.head_dim)[slots] = self.value


def flex_variants() -> dict[str, type]:
    """FLEX_ATTENTION with another layout, by benchmark name (see the module docstring)."""
    from pagedserve.attention.backends.flex_attention import (
        FlexAttentionBackend,
        FlexAttentionMetadataBuilder,
    )

    def variant(name: str, **attrs) -> type:
        builder = type(f"{name}Builder", (FlexAttentionMetadataBuilder,), attrs)
        return type(name, (FlexAttentionBackend,), {"builder_cls": builder})

    return {"FLEX_UNFOLDED": variant("FlexUnfolded", FOLD_GQA=False),
            "FLEX_PACKED": variant("FlexPacked", ALIGN_REQUESTS=False, FOLD_GQA=False),
            "FLEX_GATHER": variant("FlexGathered", physical_kv=False)}


def host_build_us(builder, setup: Setup, iters: int) -> float:
    """Median host microseconds of one step's metadata build (FLEX_ATTENTION's physical layout:
    with the block mask its first layer finishes)."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        md = builder.build(setup.common)
        if getattr(md, "physical", False):
            md.block_mask_for(setup.num_blocks)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def bench_backend(name: str, setup: Setup, args
                  ) -> tuple[float, torch.Tensor, float | str] | str:
    """(seconds, output, seconds as a CUDA graph or why not) of the backend's impl.forward,
    or why it was skipped."""
    try:
        variants = flex_variants() if name.startswith("FLEX_") else {}
        cls = variants.get(name) or get_backend_cls(name)
        ok, why = cls.is_available()
    except Exception as exc:  # a broken optional install
        return f"import failed: {exc}"
    if not ok:
        return why
    dev = setup.device
    layer = AttentionLayerConfig(args.heads, args.kv_heads, args.head_dim, torch.bfloat16)
    reasons = cls.validate_configuration(layer, args.block_size, dev)
    if reasons:
        return "; ".join(reasons)
    w = setup.w
    shape = cls.get_kv_cache_shape(setup.num_blocks, args.block_size, args.kv_heads,
                                   args.head_dim)
    kv_cache = torch.empty(shape, device=dev,
                           dtype=cls.get_kv_cache_dtype("auto", torch.bfloat16))
    k_view, v_view = cls.kv_cache_views(kv_cache)
    k_view.copy_(setup.k_cache)
    v_view.copy_(setup.v_cache)
    config = BuilderConfig(args.heads, args.kv_heads, args.head_dim, torch.bfloat16,
                           args.block_size, w.seqs, w.seqs * w.new, setup.pages, dev)
    builder = cls.get_builder_cls()(config)
    builder.warmup()  # what engine start-up does: FLEX_ATTENTION compiles flex_attention here
    print(f"  {name} host build: {host_build_us(builder, setup, 20):.0f} us")
    metadata = builder.build(setup.common)
    impl = cls.get_impl_cls()(layer)
    out = torch.empty_like(setup.query)

    def step():
        impl.forward(setup.query, setup.key, setup.value, kv_cache, metadata, output=out)

    seconds = time_cuda(step, args.warmup, args.iters)
    graphed: float | str = "not on CUDA"
    if dev.type == "cuda" and not cls.can_capture_cuda_graphs(args.block_size):
        graphed = "the backend does not capture CUDA graphs"
    elif dev.type == "cuda":
        try:
            graphed = time_graph(step, args.warmup, args.iters)
        except Exception as exc:  # a backend whose eager metadata cannot be captured
            graphed = f"{type(exc).__name__}: {exc}"
    return seconds, out, graphed


def flashinfer_runs(setup: Setup, args) -> tuple[Callable[[], torch.Tensor], str] | str:
    """A closure running FlashInfer's wrapper directly on the workload, or why not."""
    try:
        import flashinfer
    except Exception as exc:
        return f"flashinfer not importable ({exc})"
    dev = setup.device
    w, c = setup.w, setup.common
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    if w.new == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                use_tensor_cores=True)
        wrapper.plan(c.paged_kv_indptr, c.paged_kv_indices, c.paged_kv_last_page_len,
                     args.heads, args.kv_heads, args.head_dim, args.block_size,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        label = "flashinfer decode (tensor cores)"
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(c.query_start_loc, c.paged_kv_indptr, c.paged_kv_indices,
                     c.paged_kv_last_page_len, args.heads, args.kv_heads, args.head_dim,
                     args.block_size, causal=True, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)
        label = "flashinfer prefill (causal)"
    return (lambda: wrapper.run(setup.query, (setup.k_cache, setup.v_cache))), label


def write_paths(setup: Setup, args) -> list[tuple[str, Callable[[], object]]]:
    """Ways to store the step's new K/V into an NHD cache [N, 2, page, Hkv, D]: the backends'
    Triton `reshape_and_cache` (one launch), two torch `index_copy_`s on the cache flattened to
    rows, and FlashInfer's `append_paged_kv_cache` (with its per-token index build)."""
    from pagedserve.attention.backends.flashinfer import write_kv

    c, bs = setup.common, args.block_size
    kv_cache = torch.zeros(setup.num_blocks, 2, bs, args.kv_heads, args.head_dim,
                           dtype=torch.bfloat16, device=setup.device)
    key, value, slots = setup.key, setup.value, c.slot_mapping
    flat = kv_cache.view(-1, args.kv_heads, args.head_dim)

    def index_copy():
        k_rows = slots + torch.div(slots, bs, rounding_mode="floor") * bs
        flat.index_copy_(0, k_rows, key)
        flat.index_copy_(0, k_rows + bs, value)

    paths = [("reshape_and_cache (Triton)", lambda: write_kv(kv_cache, key, value, slots)),
             ("index_copy_ x2 (torch)", index_copy)]
    try:
        import flashinfer

        def append():
            batch, pos = flashinfer.page.get_batch_indices_positions(
                c.query_start_loc, c.seq_lens, key.shape[0])
            flashinfer.page.append_paged_kv_cache(
                key, value, batch, pos, kv_cache, c.paged_kv_indices, c.paged_kv_indptr,
                c.paged_kv_last_page_len, kv_layout="NHD")
        paths.append(("flashinfer append_paged_kv_cache", append))
    except Exception as exc:
        print(f"  flashinfer append_paged_kv_cache: skipped ({exc})")
    return paths


def parse_tiles(text: str | None):
    from pagedserve.attention.ops.unified_attention import TileConfig

    if not text:
        return None
    return TileConfig(*(int(x) for x in text.split(",")))


def add_workload_args(parser: argparse.ArgumentParser, warmup: int, iters: int) -> None:
    """The decode and prefill workloads' shape and timing flags (shared with triton_tiles)."""
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--iters", type=int, default=iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="TRITON,FLASHINFER,FLASH_ATTN")
    add_workload_args(parser, warmup=20, iters=100)
    parser.add_argument("--decode-tiles", help="TRITON decode block_m,block_n,warps,stages")
    parser.add_argument("--prefill-tiles", help="TRITON prefill block_m,block_n,warps,stages")
    parser.add_argument("--write", action="store_true",
                        help="also time the K/V write paths into FlashInfer's cache layout")
    parser.add_argument("--device", default="cuda",
                        help="cpu: a smoke run of this script (TRITON_INTERPRET=1, tiny sizes)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (or --device cpu for a smoke run)")

    from pagedserve.attention.ops import unified_attention as ua

    if args.decode_tiles:
        ua.DECODE_TILES = ua.DECODE_TILES_LARGE_HEAD = parse_tiles(args.decode_tiles)
    if args.prefill_tiles:
        ua.PREFILL_TILES = ua.PREFILL_TILES_LARGE_HEAD = parse_tiles(args.prefill_tiles)

    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        copy_tbs = copy_bandwidth(args.warmup, args.iters)
        mm_tflops = matmul_tflops(args.warmup, max(10, args.iters // 5))
    else:
        copy_tbs = mm_tflops = float("nan")
    print(f"device copy: {copy_tbs:.2f} TB/s (read + write); bf16 matmul 8192^3: "
          f"{mm_tflops:.0f} TFLOP/s")

    workloads = [Workload("decode", args.context - 1, 1, args.decode_seqs),
                 Workload("prefill", 0, args.prefill_len, args.prefill_seqs)]
    rows: list[Row] = []
    for w in workloads:
        setup = Setup(w, args)
        is_decode = w.new == 1
        ceiling = copy_tbs if is_decode else mm_tflops

        def record(label: str, seconds: float, w=w, is_decode=is_decode, ceiling=ceiling):
            value = (kv_bytes(w, args) / seconds / 1e12 if is_decode
                     else attention_flops(w, args) / seconds / 1e12)
            unit = "TB/s" if is_decode else "TFLOP/s"
            rows.append(Row(label, w.name, seconds * 1e6, value, ceiling))
            print(f"  {label:34s} {seconds * 1e6:9.1f} us  {value:7.2f} {unit} "
                  f"({100 * value / ceiling:.0f}% of ceiling)")

        print(f"{w.name}: {w.seqs} seqs, {w.context} cached + {w.new} new tokens, "
              f"{args.heads}:{args.kv_heads} heads, d{args.head_dim}, page {args.block_size}")
        reference = None
        for name in [n.strip().upper() for n in args.backends.split(",") if n.strip()]:
            result = bench_backend(name, setup, args)
            if isinstance(result, str):
                print(f"  {name}: skipped ({result})")
                continue
            seconds, out, graphed = result
            record(f"{name} impl.forward", seconds)
            if isinstance(graphed, str):
                print(f"  {name} impl.forward as a CUDA graph: skipped ({graphed})")
            else:
                record(f"{name} impl.forward (graph)", graphed)
            if reference is None:
                reference = (name, out.float())
            else:
                diff = (out.float() - reference[1]).abs().max().item()
                print(f"    max |{name} - {reference[0]}| = {diff:.3g}")
        if args.write:
            for label, fn in write_paths(setup, args):
                try:
                    seconds = time_cuda(fn, args.warmup, args.iters)
                except Exception as exc:
                    print(f"  write {label}: failed ({type(exc).__name__}: {exc})")
                    continue
                moved = 2 * 2 * setup.key.numel() * setup.key.element_size()  # read + write
                print(f"  write {label:32s} {seconds * 1e6:9.1f} us  "
                      f"{moved / seconds / 1e12:6.2f} TB/s")
        direct = flashinfer_runs(setup, args)
        if isinstance(direct, str):
            print(f"  flashinfer direct: skipped ({direct})")
        else:
            fn, label = direct
            record(label, time_cuda(fn, args.warmup, args.iters))
            if reference is not None:
                diff = (fn().float() - reference[1]).abs().max().item()
                print(f"    max |flashinfer - {reference[0]}| = {diff:.3g}")
        del setup
        if args.device == "cuda":
            torch.cuda.empty_cache()

    print(f"\nsummary (ceilings: copy {copy_tbs:.2f} TB/s, matmul {mm_tflops:.0f} TFLOP/s)")
    print(f"{'implementation':36s} {'workload':8s} {'time us':>9s} {'rate':>9s} {'% ceil':>7s}")
    for r in rows:
        unit = "TB/s" if r.workload == "decode" else "TF/s"
        print(f"{r.impl:36s} {r.workload:8s} {r.us:9.1f} {r.value:6.2f}{unit:>3s} "
              f"{100 * r.value / r.ceiling:6.0f}%")


if __name__ == "__main__":
    main()
