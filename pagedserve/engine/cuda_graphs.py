"""CUDA graphs for uniform steps: the model forward captured once per padded batch size.

A decode step of B requests pads to the smallest captured size P >= B: the padding requests
hold one token at position 0 whose K/V write is skipped (slot -1) and whose attention reads
page 0 of the cache, so they touch nothing real; their outputs are dropped. Backends with
their own graph buffers (FlashInfer: `build_for_cudagraph`) pad their metadata themselves and
take the real batch. Mixed and prefill steps, and decode batches larger than the largest size,
run eagerly.

The same class captures, with `query_len` q = 1+K, the verify steps of speculative decoding
whose every request has q new tokens (engine/verify_graphs.py): a padding request then holds
q tokens at positions 0..q-1, still in page 0.

Pointer stability is what makes replay right: the graph reads the runner's persistent input
ids, the common metadata builder's persistent device buffers and the backend builders' own,
which every step rewrites in place before `replay()`. `GraphInputs` is all of the runner a
graph touches.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from pagedserve.attention import AttentionBackend, AttentionMetadataBuilder
from pagedserve.attention.metadata import CommonAttentionMetadata, CommonMetadataBuilder
from pagedserve.config import EngineConfig
from pagedserve.engine.head_graphs import HeadGraphs
from pagedserve.engine.input_batch import InputIds

logger = logging.getLogger(__name__)


class StepOutputs(Protocol):
    """What a graphed forward writes besides its hidden states (a proposer's captured rows
    and K/V: spec_decode/step_graphs.py), for the start-up check to compare."""

    def clear(self, slots: torch.Tensor) -> None:
        """Zero what a step leaves at the real tokens' cache `slots`."""

    def read(self, slots: torch.Tensor) -> torch.Tensor | None:
        """What a step left there, flattened in float32 (None: nothing)."""

    def reference(self, forward: Callable[[], Any]) -> Any:
        """`forward()` with the extra work done as the eager step does it (the reference)."""


@dataclass
class GraphInputs:
    """What decode graphs read and write of the model runner."""

    # The model over the first n persistent input ids and positions under a metadata dict.
    run_model: Callable[[dict[Any, Any], int], torch.Tensor]
    common_builder: CommonMetadataBuilder
    input_ids: InputIds
    builders: dict[Any, AttentionMetadataBuilder]  # by layer configuration
    num_blocks: int  # in the KV cache (start-up batches write its first blocks)
    vocab_size: int
    # The model routes tokens to experts or rounds its activations to FP8 (`amplifies_rounding`):
    # its outputs at different batch sizes may differ by more than rounding (a flipped expert
    # choice, flipped codes), so the padded-vs-unpadded check only logs.
    amplifies_rounding: bool = False
    # With several KV cache groups: each group's table builder (the first is common_builder)
    # and the group each backend builder reads; None: one group.
    group_builders: list[CommonMetadataBuilder] | None = None
    builder_group: dict[Any, int] | None = None
    # The model's head (hidden -> float32 logits): each size also gets the head's graphs
    # (engine/head_graphs.py); None: none (tensor parallelism gathers the logits there).
    compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
    # --enable-lora: the step's routing (pagedserve.lora.batch.LoRABatch). Graphed forwards run
    # in its graph mode: the LoRA products over every block of one slot's tokens a step of
    # the graph's rows can have, read from fixed buffers (padding rows in none), whatever
    # the step at capture.
    lora: Any = None
    # A proposer with K/V of its own runs its per-step work inside run_model (after the
    # target): `after_replay(real tokens)` hands what it captured to the step, and the
    # start-up check compares `step_outputs` too. None: the forward writes nothing else.
    after_replay: Callable[[int], None] | None = None
    step_outputs: StepOutputs | None = None

    def group_metadata(self, commons: list[CommonAttentionMetadata],
                       build: Callable[[Any, CommonAttentionMetadata], Any]) -> dict[Any, Any]:
        """`build(builder, common of its group)` for every backend builder, by key."""
        group = self.builder_group or {}
        return {key: build(builder, commons[group.get(key, 0)])
                for key, builder in self.builders.items()}

    def group_commons(self, common: CommonAttentionMetadata, rows: np.ndarray,
                      tables: list[np.ndarray]) -> list[CommonAttentionMetadata]:
        """`common` (the first group's) and the other groups' metadata of the same step."""
        others = (self.group_builders or [])[1:]
        return [common] + [b.build_group(common, rows, t)
                           for b, t in zip(others, tables[1:], strict=True)]


# Batch-size rounding of a dense model, padded against unpadded: the 8B shape's random bf16
# weights reached 0.0519 relative on the H200 (2026-12-02; the check then failed at 0.05 and the
# server ran without graphs, its TPOT at 4 req/s 28 ms against 6 ms); a padding that touches
# the real rows (a stray K/V write, a wrong page) is expected far above it.
UNPADDED_RTOL = 0.25


def graph_batch_sizes(max_num_seqs: int, max_num_tokens: int,
                      configured: list[int] | None = None) -> list[int]:
    """Sizes to capture, ascending: `configured`, or 1, 2, 4, then every multiple of 8, and the
    largest batch itself; never more than a step can hold."""
    cap = min(max_num_seqs, max_num_tokens)
    if configured is None:
        configured = [1, 2, 4, *range(8, cap + 1, 8), cap]
    return sorted({int(s) for s in configured if 1 <= int(s) <= cap})



def check_padded_replay(what: str, diff: float, unpadded: float, rtol: float,
                        unpadded_rtol: float, amplifies_rounding: bool, note: str = "") -> None:
    """The start-up checks' verdict: the replay against the same padded step run eagerly
    (`diff`, within `rtol` of the largest value) and the padded step's real rows against the
    unpadded forward (`unpadded`; for a model that `amplifies_rounding` a rounding-sized miss
    is only logged: a flipped expert choice or FP8 code moves a row by more than rounding)."""
    if not diff <= rtol:  # also catches NaN
        raise RuntimeError(f"{what}: the replay differs from the same padded step run eagerly "
                           f"by {diff:.3g} (relative to the largest value{note})")
    if not math.isfinite(unpadded) or (unpadded > unpadded_rtol and not amplifies_rounding):
        raise RuntimeError(f"{what}: the padded step's real rows differ from the unpadded "
                           f"forward by {unpadded:.3g} (relative to the largest value{note})")
    if unpadded > unpadded_rtol:
        logger.info("%s: padded rows differ from the unpadded forward by %.3g (rounding that "
                    "depends on the padded size, amplified by expert routing or FP8 activations)",
                    what, unpadded)


def amplifies_rounding(model: torch.nn.Module) -> bool:
    """Whether `model` routes tokens to experts or has a layer that rounds its activations to
    a coarse format (its quantization method's `quantizes_activations`): either turns a
    rounding-sized difference into a larger one (see `check_padded_replay`)."""
    from pagedserve.models.moe import FusedMoE
    from pagedserve.quantization.base import LinearMethod

    for module in model.modules():
        if isinstance(module, FusedMoE):
            return True
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethod) and method.quantizes_activations(module):
            return True
    return False


def padded_batch_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest size in `sizes` (ascending) that holds `num_reqs`, None when none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Captured forwards of uniform steps by padded size (in requests): `query_len` new tokens
    per request, 1 for decode steps. `capture=False` keeps the padding and the graph-mode
    metadata but runs the model eagerly instead of replaying (for testing the padding on
    machines without CUDA). `verify`: the graphs of verify steps (query length 1+K), tried
    for a step that is not a pure decode."""

    def __init__(self, inputs: GraphInputs, sizes: list[int], capture: bool = True,
                 query_len: int = 1, verify: DecodeGraphs | None = None) -> None:
        self.inputs = inputs
        self.sizes = sorted(sizes)
        self.capture_graphs = capture
        self.query_len = query_len
        self.verify = verify
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # The head's graphs (GraphInputs' compute_logits; capture_heads), eager without capture.
        # A verify step's logits rows are every token's: the eager head reads them.
        self.head: HeadGraphs | None = None
        if inputs.compute_logits is not None and not capture and query_len == 1:
            self.head = HeadGraphs(inputs.compute_logits, self.outputs, None, capture=False)
        self._replaying: DecodeGraphs = self  # which graphs the prepared step replays
        self._last: tuple[int, torch.Tensor] | None = None  # the last replay's (size, hidden)
        self.replays: Counter[int] = Counter()
        self._arange = np.arange(max(self.sizes, default=0) + 1, dtype=np.int64)
        self._pool: Any = None
        self._metadata: dict[Any, Any] | None = None  # prepared for the next replay

    # ---- per step -------------------------------------------------------------------------

    def run(self, commons: list[CommonAttentionMetadata]) -> torch.Tensor | None:
        """Hidden states [num_reqs * query_len, hidden] of a uniform step through its graph
        (the step's input ids are already in the runner's buffer), or None when the step is
        not one to replay. `commons`: the step's metadata of each KV cache group."""
        size = self.prepare(commons)
        return None if size is None else self.replay(size, commons[0].num_reqs)

    def prepare(self, commons: list[CommonAttentionMetadata]) -> int | None:
        """Pad the step's metadata into the graph buffers (host work and copies only); the
        padded size to replay, or None when the step is not one to replay."""
        self._replaying = self
        size = self._prepare_size(commons) if self._prepare_own(commons[0]) else None
        if size is None and self.verify is not None:
            size = self.verify.prepare(commons)
            if size is not None:
                self._replaying = self.verify
        return size

    def _prepare_own(self, common: CommonAttentionMetadata) -> bool:
        """Whether the step is one of this query length: every request exactly q new tokens
        (q = 1: the scheduler's pure decodes). Not a q > 1 step with a same-step prefix-cache
        hit (a context block the step itself writes: backends then write first) or with
        tokens that see past themselves (image spans): its graph holds neither."""
        q, b = self.query_len, common.num_reqs
        if q == 1:
            return bool(b) and not common.num_prefills and common.max_query_len == 1
        return (bool(b) and common.max_query_len == q and common.num_actual_tokens == b * q
                and not common.context_written_in_step and common.attend_limit is None)

    def _prepare_size(self, commons: list[CommonAttentionMetadata]) -> int | None:
        size = padded_batch_size(self.sizes, commons[0].num_reqs)
        if size is None or (self.capture_graphs and size not in self.graphs):
            return None
        self._metadata = self._graph_metadata(commons, size)
        return size

    def replay(self, size: int, num_reqs: int) -> torch.Tensor:
        """Queue the prepared step's forward: the graph, or the eager model on the padded
        metadata when capture is off. Returns the real requests' rows (q each)."""
        if self._replaying is not self:
            self._last = None  # no head graphs for a verify step: its logits are eager
            return self._replaying.replay(size, num_reqs)
        metadata, self._metadata = self._metadata, None
        if self.capture_graphs:
            self.graphs[size].replay()
            hidden = self.outputs[size]
        else:
            hidden = self._forward(metadata, size)
        self.replays[size] += 1
        self._last = (size, hidden)
        if self.inputs.after_replay is not None:
            self.inputs.after_replay(num_reqs * self.query_len)
        return hidden[:num_reqs * self.query_len]

    def greedy_tokens(self, num_reqs: int) -> torch.Tensor | None:
        """The argmax token of each of the first `num_reqs` rows of the step just replayed,
        from the head's graph; None without one."""
        if self.head is None or self._last is None:
            return None
        return self.head.greedy_tokens(*self._last, num_reqs)

    def head_logits(self, num_reqs: int) -> torch.Tensor | None:
        """Float32 logits of the first `num_reqs` rows of the step just replayed, from the
        head's graph (valid until the next decode step's); None without one."""
        if self.head is None or self._last is None:
            return None
        return self.head.head_logits(*self._last, num_reqs)

    def _forward(self, metadata: dict[Any, Any], size: int) -> torch.Tensor:
        num_tokens = size * self.query_len
        lora = self.inputs.lora
        if lora is None:
            return self.inputs.run_model(metadata, num_tokens)
        lora.graph_mode = True
        try:
            return self.inputs.run_model(metadata, num_tokens)
        finally:
            lora.graph_mode = False

    def _graph_metadata(self, commons: list[CommonAttentionMetadata], size: int
                        ) -> dict[Any, Any]:
        """Each group's metadata padded into its builder's persistent buffers (the per-step
        arrays by the first group's builder, the page-dependent ones by each group's own), then
        every backend builder's graph metadata from its group's."""
        t = commons[0].num_actual_tokens
        padded = [self.inputs.common_builder.pad_decode(commons[0], size)]
        for builder, common in zip((self.inputs.group_builders or [])[1:], commons[1:],
                                   strict=True):
            padded.append(builder.pad_decode(common, size, onto=padded[0]))
        self.inputs.input_ids.pad(t, padded[0].num_actual_tokens)
        pairs = list(zip(commons, padded, strict=True))
        return self.inputs.group_metadata(
            pairs, lambda builder, pair: builder.build_for_cudagraph(pair[0], size, pair[1]))

    # ---- start-up ---------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_all(self, pool: Any = None) -> None:
        """Capture every size, largest first so the smaller ones reuse its memory pool
        (`pool`: another set's, shared; a new one by default)."""
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle() if pool is None else pool
        for size in sorted(self.sizes, reverse=True):
            self._capture(size)
        torch.cuda.synchronize(self.inputs.common_builder.device)
        logger.info("captured CUDA graphs for %s batch sizes %s in %.1f s", self.kind,
                    self.sizes, time.perf_counter() - t0)

    @property
    def memory_pool(self) -> Any:
        """The graphs' memory pool (another set captured after them may share it)."""
        return self._pool

    @property
    def kind(self) -> str:
        """What the graphs run, for logs."""
        return "decode" if self.query_len == 1 else f"verify ({self.query_len} tokens each)"

    def _capture(self, size: int) -> None:
        metadata = self._graph_metadata(self.dummy_decode(1), size)
        for _ in range(2):  # compile and autotune outside the capture
            self._forward(metadata, size)
        torch.cuda.synchronize(self.inputs.common_builder.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._forward(metadata, size)
        self.graphs[size] = graph
        self.outputs[size] = output

    @torch.inference_mode()
    def capture_heads(self) -> None:
        """Capture the head's graphs of every size (after the forwards'), then check each
        against the eager head over random hidden states written into its size's forward
        output (no forward runs: the replay counts stay the steps'). On failure they are
        dropped: the head then runs eagerly, the forwards' graphs stay."""
        if self.inputs.compute_logits is None:
            return
        heads = HeadGraphs(self.inputs.compute_logits, self.outputs, self._pool)
        generator = torch.Generator().manual_seed(0)
        try:
            heads.capture(self.inputs.common_builder.device)
            for size, hidden in self.outputs.items():
                hidden.copy_(torch.randn(hidden.shape, generator=generator))
                heads.check(size, hidden, size)
        except Exception as exc:
            logger.warning("CUDA graphs of the head failed, it runs eagerly: %s: %s",
                           type(exc).__name__, exc)
            return
        self.head = heads
        logger.info("captured the head's graphs: decode steps sample from them")

    def dummy_decode(self, num_reqs: int, context_lens: list[int] | None = None
                     ) -> list[CommonAttentionMetadata]:
        """Common metadata of each KV cache group (and zero input ids) of a uniform step (q new
        tokens each) over requests of the given cached lengths, laid out over consecutive
        blocks from 0 (the same blocks in every group). For start-up only: it writes the
        cache's first blocks, which hold no request yet."""
        cb = self.inputs.common_builder
        q = self.query_len
        context = np.array(context_lens or [0] * num_reqs, dtype=np.int32)
        if int(((context + q - 1) // cb.block_size + 1).sum()) > self.inputs.num_blocks:
            context[:] = 0  # a tiny cache: every request in one block of its own
        table = np.full((num_reqs, cb.max_blocks_per_seq), -1, dtype=np.int32)
        next_block = 0
        for row, c in enumerate(context.tolist()):
            n = (c + q - 1) // cb.block_size + 1
            table[row, :n] = np.arange(next_block, next_block + n)
            next_block += n
        rows = np.arange(num_reqs)
        # The scheduler's classes: a request of more than one new token is a prefill.
        common = cb.build(rows, context, np.full(num_reqs, q, dtype=np.int32),
                          num_reqs if q > 1 else 0, table)
        self.inputs.input_ids.pad(0, num_reqs * q)
        groups = len(self.inputs.group_builders or [cb])
        return self.inputs.group_commons(common, rows, [table] * groups)

    @torch.inference_mode()
    def check_against_eager(self, rtol: float = 0.05,
                            unpadded_rtol: float = UNPADDED_RTOL) -> float:
        """Replay the largest graph on a small real batch (3 requests of different contexts,
        q random input ids each, the rest padding) and compare it with the same padded step run
        eagerly, kernel for kernel what the graph captured: returns the max abs diff relative to
        the largest eager value, and raises when that exceeds `rtol` (a graph reading stale
        buffers is far above it).

        The real rows are also compared with an eager forward of the 3 requests alone, within
        `unpadded_rtol` (a wrong padding of the metadata would show there, far above it).
        Kernels that choose their algorithm by batch size (cuBLAS's GEMMs, the MoE GEMMs) round
        differently there: a random-weight Mixture of Experts turns one flipped expert choice
        into a different output, so for a model that routes experts that difference is
        reported, not raised, unless it is not finite."""
        inputs = self.inputs
        b = min(3, max(self.sizes))
        commons = self.dummy_decode(b, [5, 37, 18][:b])
        # Fixed ids: the check's outcome does not change from one start to the next.
        t = b * self.query_len
        ids = torch.randint(0, inputs.vocab_size, (t,), dtype=torch.int64,
                            generator=torch.Generator().manual_seed(0))
        inputs.input_ids.device[:t].copy_(ids)
        extra = _ExtraOutputs(inputs.step_outputs, commons[0].slot_mapping[:t].clone())
        eager_md = inputs.group_metadata(commons, lambda builder, common: builder.build(common))
        eager = extra.around(lambda: inputs.run_model(eager_md, t).float(), reference=True)
        # Force the largest size so the padding rows are exercised too.
        saved, size = self.sizes, max(self.sizes)
        self.sizes = [size]
        try:
            graphed = extra.around(lambda: self.run(commons))
        finally:
            self.sizes = saved
        if graphed is None:
            raise RuntimeError(f"the graph path refused a {self.kind} batch")
        graphed = graphed.float().clone()
        padded_eager = extra.around(lambda: self._forward(
            self._graph_metadata(commons, size), size)[:t].float())
        diff = max(relative_diff(graphed, padded_eager), extra.diff(1, 2))
        unpadded = max(relative_diff(padded_eager, eager), extra.diff(2, 0))
        check_padded_replay(f"{self.kind} graphs", diff, unpadded, rtol, unpadded_rtol,
                            inputs.amplifies_rounding, "; the proposer's part included")
        return diff


class _ExtraOutputs:
    """The check's reads of what each of its forwards wrote besides its hidden states
    (`GraphInputs.step_outputs` at the real tokens' `slots`), cleared before each forward so
    that one that writes nothing there differs."""

    def __init__(self, outputs: StepOutputs | None, slots: torch.Tensor) -> None:
        self.outputs, self.slots = outputs, slots
        self.reads: list[torch.Tensor | None] = []

    def around(self, forward: Callable[[], Any], reference: bool = False) -> Any:
        """`forward()` between a clear and a read (`reference`: as the eager step)."""
        if self.outputs is None:
            self.reads.append(None)
            return forward()
        self.outputs.clear(self.slots)
        result = self.outputs.reference(forward) if reference else forward()
        self.reads.append(self.outputs.read(self.slots))
        return result

    def diff(self, got: int, ref: int) -> float:
        """Relative difference of read `got` from read `ref`: 0 when neither left anything,
        infinite when only one did (or another amount)."""
        a, b = self.reads[got], self.reads[ref]
        if a is None or b is None or a.shape != b.shape:
            return 0.0 if a is None and b is None else math.inf
        return relative_diff(a, b)


def relative_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference relative to the largest reference value (NaN propagates)."""
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def setup_decode_graphs(inputs: GraphInputs, backend: type[AttentionBackend],
                        config: EngineConfig, max_model_len: int) -> DecodeGraphs | None:
    """Capture decode graphs when the engine and backend allow them; on any failure log a
    warning naming it and return None (the runner then stays eager)."""
    if config.enforce_eager or config.torch_device.type != "cuda":
        return None
    block_size = inputs.common_builder.block_size
    if not backend.can_capture_cuda_graphs(block_size):
        logger.info("CUDA graphs off: the %s backend does not support them here",
                    backend.get_name())
        return None
    for builder in inputs.builders.values():
        builder.prepare_for_cudagraphs(max_model_len)
    sizes = graph_batch_sizes(config.scheduler.max_num_seqs,
                              config.scheduler.max_num_batched_tokens, config.cuda_graph_sizes)
    if not sizes:
        return None
    graphs = DecodeGraphs(inputs, sizes)
    try:
        graphs.capture_all()
        diff = graphs.check_against_eager()
        logger.info("CUDA graph replay matches the eager forward (max diff %.2g relative)", diff)
        graphs.capture_heads()
    except Exception as exc:
        logger.warning("CUDA graph capture failed, running eagerly instead: %s: %s",
                       type(exc).__name__, exc)
        graphs.graphs.clear()
        graphs.outputs.clear()
        try:
            torch.cuda.synchronize(inputs.common_builder.device)
            torch.cuda.empty_cache()
        except Exception as sync_exc:  # a broken context is reported by the next step anyway
            logger.warning("after the failed capture: %s", sync_exc)
        return None
    return graphs
