"""CUDA graphs for pure-decode steps: the model forward captured once per padded batch size.

A decode step of B requests pads to the smallest captured size P >= B: the padding requests
hold one token at position 0 whose K/V write is skipped (slot -1) and whose attention reads
page 0 of the cache, so they touch nothing real; their outputs are dropped. Backends with
their own graph buffers (FlashInfer: `build_for_cudagraph`) pad their metadata themselves and
take the real batch. Mixed and prefill steps, and decode batches larger than the largest size,
run eagerly.

Pointer stability is what makes replay right: the graph reads the runner's persistent input
ids, the common metadata builder's persistent device buffers and the backend builders' own,
which every step rewrites in place before `replay()`.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedserve.attention.forward_context import set_forward_context
from pagedserve.scheduler.metadata import BlockTable, CommonAttentionMetadata

if TYPE_CHECKING:
    from pagedserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int, max_num_tokens: int,
                      configured: list[int] | None = None) -> list[int]:
    """Sizes to capture, ascending: `configured`, or 1, 2, 4, then every multiple of 8, and the
    largest batch itself; never more than a step can hold."""
    cap = min(max_num_seqs, max_num_tokens)
    if configured is None:
        configured = [1, 2, 4, *range(8, cap + 1, 8), cap]
    return sorted({int(s) for s in configured if 1 <= int(s) <= cap})


def padded_batch_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest size in `sizes` (ascending) that holds `num_reqs`, None when none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Captured decode forwards by padded size. `capture=False` keeps the padding and the
    graph-mode metadata but runs the model eagerly instead of replaying (for testing the
    padding on machines without CUDA)."""

    def __init__(self, runner: ModelRunner, sizes: list[int], capture: bool = True) -> None:
        self.runner = runner
        self.sizes = sorted(sizes)
        self.capture_graphs = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: Counter[int] = Counter()
        self._arange = np.arange(max(self.sizes, default=0) + 1, dtype=np.int64)
        self._pool: Any = None
        self._metadata: dict[Any, Any] | None = None  # prepared for the next replay

    # ---- per step -------------------------------------------------------------------------

    def run(self, common: CommonAttentionMetadata) -> torch.Tensor | None:
        """Hidden states [num_reqs, hidden] of a pure-decode step through its graph (the
        step's input ids are already in the runner's buffer), or None when the step is not
        one to replay."""
        size = self.prepare(common)
        return None if size is None else self.replay(size, common.num_reqs)

    def prepare(self, common: CommonAttentionMetadata) -> int | None:
        """Pad the step's metadata into the graph buffers (host work and copies only); the
        padded size to replay, or None when the step is not one to replay."""
        if common.num_prefills or common.max_query_len != 1 or not common.num_reqs:
            return None
        size = padded_batch_size(self.sizes, common.num_reqs)
        if size is None or (self.capture_graphs and size not in self.graphs):
            return None
        self._metadata = self._graph_metadata(common, size)
        return size

    def replay(self, size: int, num_reqs: int) -> torch.Tensor:
        """Queue the prepared step's forward: the graph, or the eager model on the padded
        metadata when capture is off."""
        metadata, self._metadata = self._metadata, None
        if self.capture_graphs:
            self.graphs[size].replay()
            hidden = self.outputs[size]
        else:
            hidden = self._forward(metadata, size)
        self.replays[size] += 1
        return hidden[:num_reqs]

    def _forward(self, metadata: dict[Any, Any], size: int) -> torch.Tensor:
        runner = self.runner
        with set_forward_context(metadata, runner.kv_caches):
            return runner.model(runner._input_ids[:size],
                                runner.common_builder.dev["positions"][:size])

    def _graph_metadata(self, common: CommonAttentionMetadata, size: int) -> dict[Any, Any]:
        padded = pad_decode_metadata(self.runner, common, size, self._arange)
        metadata = {}
        for cfg, builder in self.runner.builders.items():
            own = getattr(builder, "build_for_cudagraph", None)
            metadata[cfg] = own(common, size) if own is not None else builder.build(padded)
        return metadata

    # ---- start-up ---------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first so the smaller ones reuse its memory pool."""
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            self._capture(size)
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes,
                    time.perf_counter() - t0)

    def _capture(self, size: int) -> None:
        common = self.dummy_decode(1)
        metadata = self._graph_metadata(common, size)
        for _ in range(2):  # compile and autotune outside the capture
            self._forward(metadata, size)
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._forward(metadata, size)
        self.graphs[size] = graph
        self.outputs[size] = output

    def dummy_decode(self, num_reqs: int, context_lens: list[int] | None = None
                     ) -> CommonAttentionMetadata:
        """Common metadata (and zero input ids) of a decode step over requests of the given
        cached lengths, laid out over consecutive blocks from 0. For start-up only: it writes
        the cache's first blocks, which hold no request yet."""
        runner = self.runner
        context = np.array(context_lens or [0] * num_reqs, dtype=np.int32)
        if int((context // runner.block_size + 1).sum()) > runner.num_blocks:
            context[:] = 0  # a tiny cache: every request in one block of its own
        table = BlockTable(num_reqs, runner.max_blocks_per_seq)
        next_block = 0
        for row, c in enumerate(context.tolist()):
            n = c // runner.block_size + 1
            table.add_row(row, list(range(next_block, next_block + n)))
            next_block += n
        common = runner.common_builder.build(np.arange(num_reqs), context,
                                             np.ones(num_reqs, dtype=np.int32), 0, table)
        runner._input_ids_host[:num_reqs] = 0
        if runner._input_ids is not runner._input_ids_host:
            runner._input_ids[:num_reqs].copy_(runner._input_ids_host[:num_reqs])
        return common

    @torch.inference_mode()
    def check_against_eager(self, rtol: float = 0.05) -> float:
        """Replay the largest graph on a small real batch (3 requests of different contexts,
        random input ids) and compare it with the eager forward: returns the max abs diff
        relative to the largest eager value, and raises when that exceeds `rtol` (bf16 rounding
        differences are far below it; a graph reading stale buffers is far above)."""
        runner = self.runner
        b = min(3, max(self.sizes))
        common = self.dummy_decode(b, [5, 37, 18][:b])
        ids = torch.randint(0, runner.vocab_size, (b,), dtype=torch.int64)
        runner._input_ids[:b].copy_(ids)
        eager_md = {cfg: builder.build(common) for cfg, builder in runner.builders.items()}
        with set_forward_context(eager_md, runner.kv_caches):
            eager = runner.model(runner._input_ids[:b], common.positions).float()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        # Force the largest size so the padding rows are exercised too.
        saved = self.sizes
        self.sizes = [max(saved)]
        try:
            graphed = self.run(common)
        finally:
            self.sizes = saved
        if graphed is None:
            raise RuntimeError("the graph path refused a pure-decode batch")
        diff = float((graphed.float() - eager).abs().max() / eager.abs().max().clamp_min(1e-6))
        if not diff <= rtol:  # also catches NaN
            raise RuntimeError(f"graph replay differs from the eager forward by {diff:.3g} "
                               "(relative to the largest value)")
        return diff


def pad_decode_metadata(runner: ModelRunner, common: CommonAttentionMetadata, size: int,
                        arange: np.ndarray) -> CommonAttentionMetadata:
    """`common` (a pure-decode step of B requests, already built into the runner's common
    buffers) padded to `size` requests in place: entries [B, size) of every buffer are written
    on the host and copied over, so the copies the build already issued for [0, B) are left
    alone. Padding: one token at position 0 with slot -1 (no K/V write), seq_len 1, page 0."""
    cb = runner.common_builder
    h, dev = cb.np, cb.dev
    b, t = common.num_reqs, common.num_actual_tokens
    extra = size - b
    pages = int(common.paged_kv_indptr_cpu[b])
    steps = arange[1:extra + 1]
    h["query_start_loc"][b + 1:size + 1] = t + steps
    h["seq_lens"][b:size] = 1
    h["context_lens"][b:size] = 0
    h["block_table"][b:size] = -1
    h["block_table"][b:size, 0] = 0
    h["slot_mapping"][t:t + extra] = -1
    h["positions"][t:t + extra] = 0
    h["paged_kv_indptr"][b + 1:size + 1] = pages + steps
    h["paged_kv_indices"][pages:pages + extra] = 0
    h["paged_kv_last_page_len"][b:size] = 1
    runner._input_ids_host[t:t + extra] = 0
    ranges = {"query_start_loc": (b + 1, size + 1), "seq_lens": (b, size),
              "context_lens": (b, size), "block_table": (b, size), "slot_mapping": (t, t + extra),
              "positions": (t, t + extra), "paged_kv_indptr": (b + 1, size + 1),
              "paged_kv_indices": (pages, pages + extra), "paged_kv_last_page_len": (b, size)}
    if dev is not cb.host:
        for name, (lo, hi) in ranges.items():
            dev[name][lo:hi].copy_(cb.host[name][lo:hi], non_blocking=True)
        runner._input_ids[t:t + extra].copy_(runner._input_ids_host[t:t + extra],
                                             non_blocking=True)
    sizes = {"query_start_loc": size + 1, "seq_lens": size, "context_lens": size,
             "block_table": size, "slot_mapping": size, "positions": size,
             "paged_kv_indptr": size + 1, "paged_kv_indices": pages + extra,
             "paged_kv_last_page_len": size}
    views = {name: dev[name][:n] for name, n in sizes.items()}
    return dataclasses.replace(
        common, **views,
        query_start_loc_cpu=h["query_start_loc"][:size + 1], seq_lens_cpu=h["seq_lens"][:size],
        context_lens_cpu=h["context_lens"][:size],
        paged_kv_indptr_cpu=h["paged_kv_indptr"][:size + 1],
        paged_kv_last_page_len_cpu=h["paged_kv_last_page_len"][:size],
        num_reqs=size, num_actual_tokens=t + extra, max_query_len=1,
        max_seq_len=max(common.max_seq_len, 1), num_decodes=size, num_decode_tokens=t + extra)


def setup_decode_graphs(runner: ModelRunner) -> DecodeGraphs | None:
    """Capture decode graphs for the runner when the engine and backend allow them; on any
    failure log a warning naming it and return None (the runner then stays eager)."""
    config = runner.config
    if config.enforce_eager or runner.device.type != "cuda" or runner.mamba_layers:
        return None
    if not runner.backend.can_capture_cuda_graphs(runner.block_size):
        logger.info("CUDA graphs off: the %s backend does not support them here",
                    runner.backend.get_name())
        return None
    for builder in runner.builders.values():
        if hasattr(builder, "capture_max_seq_len"):  # launch bounds fixed across replays
            builder.capture_max_seq_len = runner.max_model_len
    sizes = graph_batch_sizes(runner.max_num_reqs, runner.max_num_tokens,
                              config.cuda_graph_sizes)
    if not sizes:
        return None
    graphs = DecodeGraphs(runner, sizes)
    try:
        graphs.capture_all()
        diff = graphs.check_against_eager()
        logger.info("CUDA graph replay matches the eager forward (max diff %.2g relative)", diff)
    except Exception as exc:
        logger.warning("CUDA graph capture failed, running eagerly instead: %s: %s",
                       type(exc).__name__, exc)
        graphs.graphs.clear()
        graphs.outputs.clear()
        try:
            torch.cuda.synchronize(runner.device)
            torch.cuda.empty_cache()
        except Exception as sync_exc:  # a broken context is reported by the next step anyway
            logger.warning("after the failed capture: %s", sync_exc)
        return None
    return graphs
