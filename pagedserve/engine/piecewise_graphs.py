"""Piecewise CUDA graphs for prefill and mixed steps: the model's forward captured per padded
token count N in pieces that end at each attention layer, attention itself running eagerly in
between with the step's real metadata.

A step of t <= N tokens that replays no decode graph pads to the smallest captured N: the graph
reads the runner's persistent input ids and positions ([:N], the same buffers decode graphs
read), whose rows t..N-1 hold stale but valid ids and positions of earlier steps. Every op
outside attention is row-wise (norms, projections, rotary, the router and the experts: a
padding row routes to experts of its own, which costs work but touches no real row), so the
padding never reaches the real rows; attention runs on the t real rows alone (their K/V
written, nothing for the padding) and writes its output's rows [:t], the rest zeroed so that
the next piece reads finite values. Per-tensor dynamic activation scales would be the exception
(none is in the tree: FP8 activations are scaled per token).

Capture: `Attention.forward` asks the forward context for a hook (attention/forward_context.py).
While capturing, the hook ends the current piece's graph (the layer's query, key and value were
made inside it), records the layer and the three tensors, begins the next piece's graph and
allocates the layer's output there; attention does not run. A forward of L attention layers
gives L + 1 pieces. All pieces of all sizes share one private memory pool (apart from the decode
graphs'), captured largest size first, on one side stream.

The invariant that makes the shared pool right: replay runs the pieces of one size and the
attention calls between them in capture order on one stream, and nothing else runs in the
pool meanwhile. The recorded query, key, value and output tensors are therefore kept as
non-owning views (`non_owning_view`): the pool may hand their memory to tensors of later pieces
(and other sizes), which only write it after the attention call that reads it is queued. Keeping
them alive instead would hold every layer's activations of every size at once. The last piece's
hidden states are held (the step reads them after the replay).

`capture=False` keeps the padding and the intercept but runs the pieces eagerly: the model over
N tokens, attention on the t real rows into a zeroed output (what CPU tests exercise).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.attention.forward_context import get_forward_context
from pagedserve.attention.layer import Attention
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.engine.cuda_graphs import (
    UNPADDED_RTOL,
    GraphInputs,
    check_padded_replay,
    relative_diff,
)

logger = logging.getLogger(__name__)


def piecewise_sizes(max_num_tokens: int, configured: list[int] | None = None) -> list[int]:
    """Padded token counts to capture, ascending: `configured`, or every multiple of 64 up to
    512, of 256 up to 4,096, of 512 beyond, and the step's token budget itself."""
    if configured is None:
        configured = [*range(64, 513, 64), *range(768, 4097, 256),
                      *range(4608, max_num_tokens + 1, 512), max_num_tokens]
    return sorted({int(s) for s in configured if 1 <= int(s) <= max_num_tokens})


class _DeviceBytes:
    """A device address range as a flat byte array (`__cuda_array_interface__`, no stream: no
    synchronisation): a tensor made from it neither owns nor keeps alive the memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}


@dataclass(frozen=True)
class _TensorSpec:
    """Where a tensor lies: enough to view its memory again without holding it."""

    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> _TensorSpec:
        return cls(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def view(self) -> torch.Tensor:
        """A tensor over the same memory that does not own it (the caching allocator may give
        it to another tensor)."""
        if 0 in self.shape:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        nbytes = span * self.dtype.itemsize
        if self.device.type == "cuda":
            raw = torch.as_tensor(_DeviceBytes(self.ptr, nbytes), device=self.device)
        else:  # host memory through numpy's array interface (tests)
            raw = torch.from_numpy(np.ctypeslib.as_array(
                (ctypes.c_uint8 * nbytes).from_address(self.ptr)))
        return raw.view(self.dtype).as_strided(self.shape, self.stride)


def non_owning_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements through a tensor that does not keep its memory allocated."""
    return _TensorSpec.of(t).view()


@dataclass
class _AttentionCall:
    """One attention layer's call within a padded forward of N tokens: query [N, H, D], key
    [N, Hkv, D], value [N, Hkv, Dv] and its output [N, H, Dv]."""

    layer: Attention
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    kv_cache: torch.Tensor

    @classmethod
    def of(cls, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           out: torch.Tensor, kv_cache: torch.Tensor) -> _AttentionCall:
        n = query.shape[0]
        return cls(layer, query.view(n, layer.num_heads, layer.head_size),
                   key.view(n, layer.num_kv_heads, layer.head_size),
                   value.view(n, layer.num_kv_heads, layer.head_size_v), out, kv_cache)

    def specs(self) -> tuple[_TensorSpec, ...]:
        return tuple(_TensorSpec.of(t) for t in (self.query, self.key, self.value, self.out))

    def attend(self, attn_metadata: dict[Any, Any], t: int) -> None:
        """The layer's attention over the first `t` rows, as `Attention.forward` runs it, into
        the output's rows [:t]; the padding rows zeroed."""
        layer = self.layer
        out = self.out[:t]
        got = layer.impl.forward(self.query[:t], self.key[:t], self.value[:t], self.kv_cache,
                                 attn_metadata[layer.metadata_key], output=out)
        if got.data_ptr() != out.data_ptr():  # an impl that ignores `output`
            out.copy_(got.view(out.shape))
        if t < self.out.shape[0]:
            self.out[t:].zero_()


class PiecewiseGraphs:
    """The forwards of steps of up to max(sizes) tokens by padded token count (module
    docstring). `inputs.run_model` must take `attention_hook` (the runner's does)."""

    def __init__(self, inputs: GraphInputs, sizes: list[int], capture: bool = True) -> None:
        self.inputs = inputs
        self.sizes = sorted(sizes)
        self.capture_graphs = capture
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[_AttentionCall]] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # the last piece's hidden states, held
        self.replays: Counter[int] = Counter()
        self._pool: Any = None
        self._stream: Any = None
        self._step: tuple[dict[Any, Any], int] | None = None  # eager pieces: (metadata, t)
        # While one size is being captured: its graphs so far, and its calls' tensors.
        self._graph: Any = None
        self._captured: list[Any] = []
        self._recorded: list[tuple[Attention, torch.Tensor, tuple[_TensorSpec, ...]]] = []

    @property
    def num_pieces(self) -> dict[int, int]:
        return {size: len(p) for size, p in self.pieces.items()}

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    # ---- per step -------------------------------------------------------------------------

    def run(self, attn_metadata: dict[Any, Any], num_tokens: int) -> torch.Tensor | None:
        """Hidden states [t, hidden] of a step of t = `num_tokens` tokens (its ids and positions
        already in the runner's buffers, its metadata built), or None when no size holds it."""
        size = self.padded_size(num_tokens)
        if size is None or (self.capture_graphs and size not in self.pieces):
            return None
        self.replays[size] += 1
        if not self.capture_graphs:
            return self._forward_eager(attn_metadata, num_tokens, size)[:num_tokens]
        pieces = self.pieces[size]
        for graph, call in zip(pieces, self.calls[size], strict=False):  # one piece more
            graph.replay()
            call.attend(attn_metadata, num_tokens)
        pieces[-1].replay()
        return self.outputs[size][:num_tokens]

    def _forward_eager(self, attn_metadata: dict[Any, Any], num_tokens: int, size: int
                       ) -> torch.Tensor:
        self._step = (attn_metadata, num_tokens)
        try:
            return self.inputs.run_model(attn_metadata, size,
                                         attention_hook=self._eager_attention)
        finally:
            self._step = None

    def _eager_attention(self, layer: Attention, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> torch.Tensor:
        assert self._step is not None
        attn_metadata, t = self._step
        n = query.shape[0]
        out = query.new_zeros(n, layer.num_heads, layer.head_size_v)
        kv_cache = get_forward_context().kv_caches[layer.layer_idx]
        _AttentionCall.of(layer, query, key, value, out, kv_cache).attend(attn_metadata, t)
        return out.view(n, -1)

    # ---- start-up ---------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first, into one new pool on one side stream."""
        device = self.inputs.common_builder.device
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            self._capture(size, device)
        torch.cuda.synchronize(device)
        logger.info("captured piecewise CUDA graphs for %d token counts %s (%s pieces each) "
                    "in %.1f s", len(self.sizes), self.sizes,
                    sorted(set(self.num_pieces.values())), time.perf_counter() - t0)

    def _capture(self, size: int, device: torch.device) -> None:
        run_model = self.inputs.run_model
        torch.cuda.synchronize(device)
        with torch.cuda.stream(self._stream):
            # Triton's compiles, cuBLAS's workspace for this stream and M = size: outside.
            run_model({}, size, attention_hook=_skip_attention)
        torch.cuda.synchronize(device)
        self._captured, self._recorded = [], []
        with torch.cuda.stream(self._stream):
            self._graph = torch.cuda.CUDAGraph()
            self._graph.capture_begin(pool=self._pool)
            try:
                hidden = run_model({}, size, attention_hook=self._split)
            finally:
                self._graph.capture_end()
        self._captured.append(self._graph)
        calls = []
        for layer, kv_cache, specs in self._recorded:  # views made outside the capture
            query, key, value, out = (s.view() for s in specs)
            calls.append(_AttentionCall(layer, query, key, value, out, kv_cache))
        self.pieces[size], self.calls[size], self.outputs[size] = self._captured, calls, hidden
        self._graph, self._captured, self._recorded = None, [], []

    def _split(self, layer: Attention, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> torch.Tensor:
        """The capture's hook: end this piece, begin the next, allocate the layer's output
        there (q/k/v are alive: it cannot alias them) and record where all four lie."""
        self._graph.capture_end()
        self._captured.append(self._graph)
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self._pool)
        n = query.shape[0]
        out = torch.empty((n, layer.num_heads, layer.head_size_v), dtype=query.dtype,
                          device=query.device)
        call = _AttentionCall.of(layer, query, key, value, out,
                                 get_forward_context().kv_caches[layer.layer_idx])
        self._recorded.append((layer, call.kv_cache, call.specs()))
        return out.view(n, -1)

    def drop(self) -> None:
        """Forget every graph (after a failed capture or check)."""
        self.pieces.clear()
        self.calls.clear()
        self.outputs.clear()

    def dummy_mixed_step(self) -> tuple[list[CommonAttentionMetadata], int]:
        """Each KV cache group's common metadata of a start-up step: a prefill over cached
        context, a prefill from scratch and a decode (as many as the limits allow), laid out
        over consecutive blocks from 0 (which no request holds yet); and its token count,
        which leaves padding below the largest size where it can."""
        cb = self.inputs.common_builder
        budget = max(1, min(32, max(self.sizes) - 1))
        first = max(1, budget * 5 // 8)
        new = np.array([first, max(1, budget - first - 1), 1], dtype=np.int32)
        context = np.array([37, 0, 5], dtype=np.int32)
        keep = max(1, min(3, len(cb.np["seq_lens"])))
        while keep > 1 and int(new[:keep].sum()) > max(self.sizes):
            keep -= 1
        new, context = new[:keep], context[:keep]
        new[0] = min(int(new[0]), max(self.sizes))
        pages = (context + new + cb.block_size - 1) // cb.block_size
        if int(pages.max()) > cb.max_blocks_per_seq or int(pages.sum()) > self.inputs.num_blocks:
            context[:] = 0
            pages = (new + cb.block_size - 1) // cb.block_size
        table = np.full((keep, cb.max_blocks_per_seq), -1, dtype=np.int32)
        start = 0
        for row, n in enumerate(pages.tolist()):
            table[row, :n] = np.arange(start, start + n)
            start += n
        rows = np.arange(keep)
        num_prefills = int((new > 1).sum()) if keep > 1 else 1
        common = cb.build(rows, context, new, num_prefills, table)
        groups = len(self.inputs.group_builders or [cb])
        return self.inputs.group_commons(common, rows, [table] * groups), int(new.sum())

    @torch.inference_mode()
    def check_against_eager(self, rtol: float = 0.05,
                            unpadded_rtol: float = UNPADDED_RTOL) -> float:
        """Run a mixed step (`dummy_mixed_step`, random ids) through the pieces at its padded
        size and compare with the same padded step run eagerly piece by piece (the same
        kernels: within `rtol` of the largest value, else raise), and the eager step's real
        rows with the plain unpadded forward (within `unpadded_rtol`; for a model that routes
        experts only reported, as the decode graphs' check does). Returns the first."""
        inputs = self.inputs
        commons, t = self.dummy_mixed_step()
        ids = torch.randint(0, inputs.vocab_size, (t,), dtype=torch.int64,
                            generator=torch.Generator().manual_seed(0))
        inputs.input_ids.device[:t].copy_(ids)
        metadata = inputs.group_metadata(commons, lambda b, common: b.build_step(common))
        eager = inputs.run_model(metadata, t).float()
        got = self.run(metadata, t)
        if got is None:
            raise RuntimeError(f"no piecewise graph holds a step of {t} tokens")
        got = got.float().clone()
        size = self.padded_size(t)
        padded = self._forward_eager(metadata, t, size)[:t].float()
        self.replays.clear()  # the check's is no step's
        diff = relative_diff(got, padded)
        check_padded_replay(f"piecewise graphs at {size} tokens", diff,
                            relative_diff(padded, eager), rtol, unpadded_rtol,
                            inputs.amplifies_rounding)
        return diff


def _skip_attention(layer: Attention, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> torch.Tensor:
    """A warm-up forward's attention: zeros, nothing read or written."""
    return query.new_zeros(query.shape[0], layer.num_heads * layer.head_size_v)


def decline_reason(runner: Any) -> str | None:
    """Why the runner's steps cannot run piecewise graphs, None when they can. `runner`: the
    ModelRunner (its model, its parts and its config)."""
    from pagedserve.attention.mla import MLAAttention

    if runner.config.enforce_eager:
        return "enforce_eager is set"
    checks = (
        (runner.tp_size > 1, "tensor parallelism (the all-reduces are not in the pieces)"),
        (runner.lora is not None, "LoRA (its routing is not in the pieces)"),
        (runner.speculator is not None, "speculative decoding"),
        (bool(runner.state_layers), "state layers (Mamba, linear attention) read the step"),
        (runner.multimodal is not None, "a multimodal model (image rows and M-RoPE)"),
        (runner.pooler is not None, "a pooling runner"),
        (not runner.attn_layers, "no attention layers"),
        (any(isinstance(m, MLAAttention) for m in runner.attn_layers),
         "MLA layers (their attention does not go through Attention.forward)"),
        (runner.device.type != "cuda", "they need CUDA"),
    )
    return next((why for declined, why in checks if declined), None)


def setup_piecewise_graphs(runner: Any) -> PiecewiseGraphs | None:
    """Capture and check the piecewise graphs when configured and allowed (a refusal is logged
    once, with its reason); on any failure log a warning naming it and return None: prefill
    and mixed steps then run eagerly."""
    config = runner.config
    if not config.piecewise_cuda_graphs:
        return None
    reason = decline_reason(runner)
    if reason is not None:
        logger.info("piecewise CUDA graphs off: %s", reason)
        return None
    sizes = piecewise_sizes(runner.max_num_tokens, config.piecewise_graph_sizes)
    if not sizes:
        return None
    graphs = PiecewiseGraphs(runner.graph_inputs(), sizes)
    try:
        graphs.capture_all()
        diff = graphs.check_against_eager()
        logger.info("piecewise graph replay matches the eager forward (max diff %.2g "
                    "relative)", diff)
    except Exception as exc:
        logger.warning("piecewise CUDA graphs failed, prefill and mixed steps run eagerly: "
                       "%s: %s", type(exc).__name__, exc)
        graphs.drop()
        try:
            torch.cuda.synchronize(runner.device)
            torch.cuda.empty_cache()
        except Exception as sync_exc:  # a broken context is reported by the next step anyway
            logger.warning("after the failed capture: %s", sync_exc)
        return None
    return graphs
