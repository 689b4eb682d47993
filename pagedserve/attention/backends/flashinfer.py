"""FlashInfer backend: paged prefill and decode kernels from `flashinfer-python`.

The split of work follows FlashInfer's own: the builder does the host work once per step (it
slices the step's CSR page table into a prefill part and a decode part and `plan()`s one wrapper
for each), and every layer's `forward` only launches kernels (`run()`). Prefill requests come
first in a step, so the prefill wrapper sees tokens [0, num_prefill_tokens) and the decode
wrapper the rest. One builder serves one layer configuration: window and soft-cap are baked into
a plan, so layers that differ in them get builders of their own.

The cache is FlashInfer's NHD layout, [num_blocks, 2 (K, V), block_size, num_kv_heads,
head_size]. `flashinfer` is imported lazily: listing backends on a machine without it or without
CUDA imports nothing GPU-only.

Attention sinks (gpt-oss). FlashInfer 0.7.4's plain wrappers accept `run(..., sinks=...)`, but
only its trtllm-gen (Blackwell) and cuDNN paths read it: the fa2/fa3 kernels that run here on
Hopper drop it without a word. The supported path on Hopper is FlashInfer's attention-sink
variant, JIT-built for fa2 and fa3: `BatchAttentionWithAttentionSinkWrapper` (a prefill wrapper)
and `BatchDecodeWithAttentionSinkWrapper` (the tensor-core decode path, CUDA-graph capable).
A builder of a sink layer plans those instead; their run() takes the float32 sink logits [H]
and the softmax scale as positional arguments. The variant has no soft-cap, so a sink layer
with one is refused.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    BuilderConfig,
    diff_kv_reason,
)
from pagedserve.attention.backends import encoder_gpu
from pagedserve.attention.backends.flashinfer_metadata import FlashInferMetadata
from pagedserve.attention.backends.flashinfer_verify import FlashInferVerifyBuilder
from pagedserve.attention.metadata import CommonAttentionMetadata, CommonMetadataBuilder

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20
INSTALL_HINT = ("pip install flashinfer-python (or the project's cuda extra: "
                "pip install 'pagedserve[cuda]')")


def import_flashinfer(submodule: str | None = None) -> tuple[Any | None, str]:
    """(flashinfer, "") where it can run (installed, importable, an NVIDIA GPU), else (None,
    why not). `submodule` is imported too ("mla")."""
    reasons = []
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append(f"flashinfer-python is not installed: {INSTALL_HINT}")
    if not torch.cuda.is_available() or torch.version.hip:
        reasons.append("needs an NVIDIA CUDA GPU, and none is visible")
    if reasons:
        return None, "; ".join(reasons)
    try:
        import flashinfer

        if submodule is not None:
            importlib.import_module(f"flashinfer.{submodule}")
    except Exception as exc:  # a broken install names itself rather than crash listing
        return None, f"flashinfer failed to import ({exc}); reinstall: {INSTALL_HINT}"
    return flashinfer, ""


# ---- host-side CSR slicing (no flashinfer needed; tested on the CPU) --------------------------

@dataclass
class CSRPart:
    """A contiguous run of a step's requests [req_start, req_end) in FlashInfer's CSR form:
    host arrays rebased to start at 0; the page ids stay on the device as
    `paged_kv_indices[page_start:page_end]` of the step's metadata."""

    req_start: int
    req_end: int
    token_start: int
    token_end: int
    page_start: int
    page_end: int
    qo_indptr: np.ndarray  # [n+1] int32
    kv_indptr: np.ndarray  # [n+1] int32
    kv_last_page_len: np.ndarray  # [n] int32

    @property
    def num_reqs(self) -> int:
        return self.req_end - self.req_start


def csr_part(query_start_loc: np.ndarray, paged_kv_indptr: np.ndarray,
             paged_kv_last_page_len: np.ndarray, start: int, end: int,
             qo_out: np.ndarray | None = None, kv_out: np.ndarray | None = None) -> CSRPart:
    """Requests [start, end) of a step's CSR page table. The part starting at request 0 is
    returned as views; a later part has its indptrs rebased into `qo_out`/`kv_out` (persistent
    buffers, so host memory stays pinned) or into new arrays."""
    n = end - start
    qo, kv = query_start_loc[start:end + 1], paged_kv_indptr[start:end + 1]
    if start:
        qo = np.subtract(qo, qo[0], out=None if qo_out is None else qo_out[:n + 1])
        kv = np.subtract(kv, kv[0], out=None if kv_out is None else kv_out[:n + 1])
    return CSRPart(start, end, int(query_start_loc[start]), int(query_start_loc[end]),
                   int(paged_kv_indptr[start]), int(paged_kv_indptr[end]), qo, kv,
                   paged_kv_last_page_len[start:end])


def split_prefill_decode(common: CommonAttentionMetadata, qo_out: np.ndarray | None = None,
                         kv_out: np.ndarray | None = None
                         ) -> tuple[CSRPart | None, CSRPart | None]:
    """The step's prefill part [0, num_prefills) and decode part [num_prefills, num_reqs)."""
    args = (common.query_start_loc_cpu, common.paged_kv_indptr_cpu,
            common.paged_kv_last_page_len_cpu)
    p, b = common.num_prefills, common.num_reqs
    prefill = csr_part(*args, 0, p) if p else None
    decode = csr_part(*args, p, b, qo_out, kv_out) if b > p else None
    return prefill, decode


def pad_decode_csr(part: CSRPart, num_reqs_padded: int, kv_indptr_out: np.ndarray,
                   last_page_len_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decode part's indptr and last-page lengths padded to `num_reqs_padded` requests for
    a captured CUDA graph: each padding request owns one page (whose id the caller sets, e.g. 0)
    holding one token, so the kernels read valid memory and their outputs are simply unused."""
    n, total = part.num_reqs, part.page_end - part.page_start
    indptr = kv_indptr_out[:num_reqs_padded + 1]
    indptr[:n + 1] = part.kv_indptr
    indptr[n + 1:] = total + np.arange(1, num_reqs_padded - n + 1)
    last = last_page_len_out[:num_reqs_padded]
    last[:n] = part.kv_last_page_len
    last[n:] = 1
    return indptr, last


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new K/V [T, Hkv, D] into the NHD cache at `slot_mapping` (-1 = skip); a quantised
    (fp8) cache stores K / k_scale and V / v_scale.

    One Triton `reshape_and_cache` launch for K and V together (it takes the strided K and V
    views of the cache and fuses the fp8 cast); it replaced two `index_copy_`s and, for fp8, the
    separate scale and cast kernels. FlashInfer's own `append_paged_kv_cache` needs per-token
    batch indices and positions (one more launch per step); `benchmarks/attention_kernels.py
    --write-bench` times the three.
    """
    from pagedserve.attention.ops.reshape_and_cache import reshape_and_cache  # triton

    k_cache, v_cache = FlashInferBackend.kv_cache_views(kv_cache)
    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                      v_scale=v_scale)


# ---- metadata and builder ---------------------------------------------------------------------

@dataclass
class _GraphDecode:
    wrapper: Any
    metadata: FlashInferMetadata


class FlashInferMetadataBuilder(encoder_gpu.FlashInferEncoderBuilder, FlashInferVerifyBuilder,
                                AttentionMetadataBuilder):
    """Plans FlashInfer's wrappers once per step for one layer configuration. Eager steps:
    `build(common)`. CUDA-graph decode steps (pure decode, padded to a captured batch size):
    `build_for_cudagraph(common, num_reqs_padded)`; uniform verify steps (q > 1 tokens each):
    the same call, through `flashinfer_verify`; encoder-only layers: `build_encoder`."""

    def __init__(self, config: BuilderConfig) -> None:
        super().__init__(config)
        import flashinfer

        self._flashinfer = flashinfer
        self.device = config.device
        self.kv_cache_dtype = FlashInferBackend.get_kv_cache_dtype(config.kv_cache_dtype,
                                                                   config.dtype)
        # FlashInfer's window is the keys a query sees besides itself.
        self.window_left = -1 if config.sliding_window is None else config.sliding_window - 1
        # One workspace for both wrappers: it only holds a run's transient split-KV partials,
        # and runs are serialised on the stream.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = self._prefill_wrapper()
        self.decode_wrapper = self._decode_wrapper()
        # Rebased indptrs of the decode part, in pinned memory so plan()'s copies are async.
        pin = self.device.type == "cuda"
        n = config.max_num_reqs + 1
        self._qo_indptr_host = torch.zeros(n, dtype=torch.int32, pin_memory=pin).numpy()
        self._kv_indptr_host = torch.zeros(n, dtype=torch.int32, pin_memory=pin).numpy()
        self._graphs: dict[int, _GraphDecode] = {}
        self._graph_buffers: dict[str, torch.Tensor] | None = None
        self._init_verify_graphs()

    def _prefill_wrapper(self) -> Any:
        if self.config.has_sinks:
            return self._flashinfer.BatchAttentionWithAttentionSinkWrapper(
                self.workspace, "NHD", **self._sink_variant())
        return self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def _decode_wrapper(self, **graph_buffers: torch.Tensor) -> Any:
        graph = bool(graph_buffers)
        if self.config.has_sinks:  # the sink variant runs the tensor-core path only
            return self._flashinfer.BatchDecodeWithAttentionSinkWrapper(
                self.workspace, "NHD", use_cuda_graph=graph, **self._sink_variant(),
                **graph_buffers)
        # Tensor cores always: the measured GQA decode is 1.4x faster with them, and the
        # decode then shares the prefill's fa2 kernel, so there is one JIT compile, not two.
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=graph, use_tensor_cores=True, **graph_buffers)

    def _sink_variant(self) -> dict[str, Any]:
        """What the attention-sink wrappers compile their JIT variant for."""
        c = self.config
        return dict(q_data_type=c.dtype, kv_data_type=self.kv_cache_dtype,
                    head_dim_qk=c.head_size, head_dim_vo=c.head_size,
                    window_left=self.window_left)

    def _plan_kwargs(self) -> dict[str, Any]:
        c = self.config
        return dict(window_left=self.window_left, logits_soft_cap=c.logits_soft_cap,
                    q_data_type=c.dtype, kv_data_type=self.kv_cache_dtype)

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        c = self.config
        prefill, decode = split_prefill_decode(common, self._qo_indptr_host,
                                               self._kv_indptr_host)
        # plan() reads indptrs and last-page lengths on the host (its scheduler) and copies
        # them over; page ids it only copies, so they go from the device copy.
        if prefill is not None:
            self.prefill_wrapper.plan(
                torch.from_numpy(prefill.qo_indptr), torch.from_numpy(prefill.kv_indptr),
                common.paged_kv_indices[prefill.page_start:prefill.page_end],
                torch.from_numpy(prefill.kv_last_page_len), c.num_heads, c.num_kv_heads,
                c.head_size, c.block_size, causal=True, **self._plan_kwargs())
        if decode is not None:
            self.decode_wrapper.plan(
                torch.from_numpy(decode.kv_indptr),
                common.paged_kv_indices[decode.page_start:decode.page_end],
                torch.from_numpy(decode.kv_last_page_len), c.num_heads, c.num_kv_heads,
                c.head_size, c.block_size, **self._plan_kwargs())
        return FlashInferMetadata(
            num_prefill_tokens=common.num_prefill_tokens,
            num_decode_tokens=common.num_decode_tokens,
            slot_mapping=common.slot_mapping[:common.num_actual_tokens],
            prefill=self.prefill_wrapper if prefill else None,
            decode=self.decode_wrapper if decode else None, has_sinks=self.config.has_sinks)

    def build_for_cudagraph(self, common: CommonAttentionMetadata, num_reqs_padded: int,
                            padded: CommonAttentionMetadata | None = None
                            ) -> FlashInferMetadata:
        """Metadata for a pure-decode step run as a CUDA graph of `num_reqs_padded` requests,
        planned from the real step `common` (FlashInfer pads its own CSR; `padded` is unused).
        A uniform step of q > 1 tokens a request (a verify step) goes to `build_verify_graph`,
        planned from `padded`.

        Returns the same object, over the same persistent buffers, every time for a given
        padded size. The model runner uses it twice:

        - capture (once per size, at start-up): build `common` for a dummy decode batch of
          at most `num_reqs_padded` requests, call this, run the model once eagerly with
          inputs padded to `num_reqs_padded` tokens, then capture the model forward under
          `set_forward_context({config: metadata}, kv_caches)`;
        - replay (each pure-decode step with num_decodes <= num_reqs_padded): build `common`
          as usual, call this (it rewrites the buffers in place and re-plans the size's
          wrapper, host work of a fraction of a millisecond), copy the step's input ids and
          positions into the graph's static inputs, replay.

        Padding requests attend over one token of block 0 and write no K/V (slot -1); their
        outputs are to be dropped.
        """
        if common.max_query_len > 1:
            return self.build_verify_graph(common, num_reqs_padded, padded)
        c = self.config
        n, bp = common.num_decodes, num_reqs_padded
        if common.num_prefills or not 0 < n <= bp:
            raise ValueError(f"a CUDA-graph step is 1..{bp} decodes and no prefill, got "
                             f"{common.num_prefills} prefills and {n} decodes")
        bufs = self._graph_buffers or self._alloc_graph_buffers()
        graph = self._graphs.get(bp) or self._new_graph(bp, bufs)
        _, part = split_prefill_decode(common, self._qo_indptr_host, self._kv_indptr_host)
        indptr, last = pad_decode_csr(part, bp, bufs["kv_indptr_host"].numpy(),
                                      bufs["last_page_len_host"].numpy())
        total = part.page_end - part.page_start
        indices = bufs["kv_indices"]
        indices[:total].copy_(common.paged_kv_indices[part.page_start:part.page_end])
        indices[total:total + bp - n].zero_()
        # plan() copies the page ids into the wrapper's buffer, which is this one: a copy of a
        # view onto itself, which torch skips.
        graph.wrapper.plan(torch.from_numpy(indptr), indices[:total + bp - n],
                           torch.from_numpy(last), c.num_heads, c.num_kv_heads, c.head_size,
                           c.block_size, **self._plan_kwargs())
        bufs["slots"][:n].copy_(common.slot_mapping[:n])
        bufs["slots"][n:bp].fill_(-1)
        return graph.metadata

    def _alloc_graph_buffers(self) -> dict[str, torch.Tensor]:
        c = self.config
        r = c.max_num_reqs
        pin = self.device.type == "cuda"
        dev = {"kv_indptr": (r + 1, torch.int32), "last_page_len": (r, torch.int32),
               "kv_indices": (r * c.max_blocks_per_seq, torch.int32),
               "slots": (r, torch.int64)}
        bufs = {name: torch.zeros(n, dtype=dt, device=self.device) for name, (n, dt) in
                dev.items()}
        for name in ("kv_indptr", "last_page_len"):
            n, dt = dev[name]
            bufs[name + "_host"] = torch.zeros(n, dtype=dt, pin_memory=pin)
        self._graph_buffers = bufs
        return bufs

    def _new_graph(self, bp: int, bufs: dict[str, torch.Tensor]) -> _GraphDecode:
        # Every size's wrapper reads views of the same device buffers: one graph replays per
        # step, and its plan() rewrites them just before.
        wrapper = self._decode_wrapper(paged_kv_indptr_buffer=bufs["kv_indptr"][:bp + 1],
                                       paged_kv_indices_buffer=bufs["kv_indices"],
                                       paged_kv_last_page_len_buffer=bufs["last_page_len"][:bp])
        metadata = FlashInferMetadata(
            num_prefill_tokens=0, num_decode_tokens=bp, slot_mapping=bufs["slots"][:bp],
            prefill=None, decode=wrapper, has_sinks=self.config.has_sinks)
        self._graphs[bp] = _GraphDecode(wrapper, metadata)
        return self._graphs[bp]

    def warmup(self) -> None:
        """Plan and run a tiny step of each kernel this configuration uses, so FlashInfer's JIT
        compiles them at start-up instead of during the first request. Prefill takes FlashInfer's
        fa2 kernel for queries up to 64 tokens and fa3 (SM90) above, so both run."""
        c = self.config
        logger.info("FlashInfer: compiling kernels for head_dim=%d (%s, KV %s, window %s, "
                    "soft-cap %s, sinks %s), this takes ~90 s once", c.head_size, c.dtype,
                    self.kv_cache_dtype, c.sliding_window, c.logits_soft_cap, c.has_sinks)
        t0 = time.perf_counter()
        long_prompt = 80
        blocks = -(-(long_prompt + 2) // c.block_size)
        table = np.full((2, blocks), -1, dtype=np.int32)
        table[0] = np.arange(blocks)
        table[1, 0] = blocks
        common_builder = CommonMetadataBuilder(2, long_prompt + 1, blocks, c.block_size,
                                               self.device)
        impl = FlashInferImpl(AttentionLayerConfig(
            c.num_heads, c.num_kv_heads, c.head_size, c.dtype, c.sliding_window,
            c.logits_soft_cap, c.kv_cache_dtype, has_sinks=c.has_sinks))
        if c.has_sinks:
            impl.bind_sinks(torch.zeros(c.num_heads, dtype=c.dtype, device=self.device))
        kv_cache = torch.zeros(FlashInferBackend.get_kv_cache_shape(
            blocks + 1, c.block_size, c.num_kv_heads, c.head_size), dtype=self.kv_cache_dtype,
            device=self.device)
        # A long prompt with a one-token decode (fa3 prefill, decode), then a short chunk of
        # the same prompt (fa2 prefill).
        for computed, scheduled in (([0, 0], [long_prompt, 1]), ([long_prompt], [2])):
            common = common_builder.build(np.arange(len(computed)),
                                          np.array(computed, dtype=np.int32),
                                          np.array(scheduled, dtype=np.int32), 1, table)
            t = common.num_actual_tokens
            q = torch.randn(t, c.num_heads, c.head_size, dtype=c.dtype, device=self.device)
            kv = torch.randn(t, c.num_kv_heads, c.head_size, dtype=c.dtype, device=self.device)
            impl.forward(q, kv, kv, kv_cache, self.build(common))
            if self.device.type == "cuda":
                # The next step rewrites the pinned host buffers this one copies from.
                torch.cuda.synchronize(self.device)
        logger.info("FlashInfer: kernels ready for head_dim=%d in %.1f s", c.head_size,
                    time.perf_counter() - t0)


# ---- implementation ---------------------------------------------------------------------------

class FlashInferImpl(encoder_gpu.FlashInferEncoderImpl, AttentionImpl):
    supports_sinks = True

    def __init__(self, layer: AttentionLayerConfig) -> None:
        super().__init__(layer)
        # FlashInfer folds an fp8 cache's k_scale (the base class's) into the softmax scale.
        # The plan uses FlashInfer's default softmax scale 1/sqrt(head_size); a model's own
        # scale rides on k_scale, which multiplies the same product q.k.
        self._scale_ratio = self.scale * self.head_size ** 0.5
        self._sinks_f32: torch.Tensor | None = None  # see _float32_sinks

    def bind_sinks(self, sinks: torch.Tensor) -> None:
        super().bind_sinks(sinks)
        self._sinks_f32 = None

    def _run_args(self, sink_variant: bool, k_scale: float,
                  v_scale: float) -> tuple[tuple[Any, ...], dict[str, float]]:
        """run()'s positional and scale arguments. The sink variant takes (sinks, sm_scale)
        after the cache, and k_scale, which multiplies the same product q.k, folds into that
        sm_scale; the plain wrappers plan the default scale and take the model's through
        k_scale."""
        if sink_variant:
            return ((self._float32_sinks(), float(self.scale * k_scale)),
                    dict(v_scale=float(v_scale)))
        return (), dict(k_scale=float(k_scale * self._scale_ratio), v_scale=float(v_scale))

    def _float32_sinks(self) -> torch.Tensor:
        """The sink variant reads float32 logits. A model in another dtype gets one float32
        copy, made at the first forward (weights are loaded by then) and kept, so every step
        and a captured graph read the same tensor."""
        sinks = self.bound_sinks()
        assert sinks is not None
        if sinks.dtype == torch.float32:
            return sinks.detach()
        if self._sinks_f32 is None:
            self._sinks_f32 = sinks.detach().float()
        return self._sinks_f32

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FlashInferMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        if md.has_sinks != self.layer.has_sinks:  # the other wrappers would drop or want sinks
            raise ValueError(f"metadata planned {'with' if md.has_sinks else 'without'} sinks "
                             f"for a layer with has_sinks={self.layer.has_sinks}")
        # Scales belong to a quantised cache; a cache in the model dtype holds K/V as they are.
        quantized = kv_cache.dtype != query.dtype
        k_scale, v_scale = (self.k_scale, self.v_scale) if quantized else (1.0, 1.0)
        write_kv(kv_cache, key, value, md.slot_mapping, k_scale, v_scale)
        if output is None:
            output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        p, d = md.num_prefill_tokens, md.num_decode_tokens
        args, scales = self._run_args(md.has_sinks, k_scale, v_scale)
        if md.prefill is not None:
            md.prefill.run(query[:p], kv_cache, *args, out=output[:p], **scales)
        if md.decode is not None:
            md.decode.run(query[p:p + d], kv_cache, *args, out=output[p:p + d], **scales)
        return output


# ---- backend ----------------------------------------------------------------------------------

class FlashInferBackend(AttentionBackend):
    name = "FLASHINFER"
    reads_paged_kv_indices = True
    supported_head_sizes = (64, 128, 256)
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "fp8")
    supports_sliding_window = True
    supports_soft_cap = True
    supports_sinks = True  # through FlashInfer's attention-sink variant (module docstring)
    supports_cuda_graphs = True
    # Verify steps through per-size graph prefill wrappers (flashinfer_verify.py); a sink
    # layer's builder declines them (verify_graph_reason).
    supports_uniform_query_graphs = True
    supports_encoder_only = True  # the ragged prefill wrapper, causal=False (encoder_gpu.py)
    description = "FlashInfer paged prefill (fa2/fa3) and tensor-core decode, NHD cache"

    impl_cls = FlashInferImpl
    builder_cls = FlashInferMetadataBuilder
    metadata_cls = FlashInferMetadata

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, head_size_v: int | None = None) -> tuple[int, ...]:
        # K and V share one page ([num_blocks, 2, ...]): no layout for values of another size
        # (supports_diff_kv is off, so no such layer gets here through the engine).
        if head_size_v is not None:
            raise ValueError(f"FLASHINFER: {diff_kv_reason(head_size, head_size_v)}")
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def kv_cache_views(kv_cache: torch.Tensor,
                       head_size_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if head_size_v is not None:
            raise ValueError("FLASHINFER caches hold K and V of one head size")
        return kv_cache[:, 0], kv_cache[:, 1]

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        flashinfer, why_not = import_flashinfer()
        if flashinfer is None:
            return False, why_not
        return True, f"FlashInfer {flashinfer.__version__} paged prefill/decode"

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        reasons = super().validate_configuration(layer, block_size, device)
        if device.type != "cuda":
            reasons.append(f"FlashInfer runs on CUDA devices, not {device.type}")
        if layer.has_sinks and layer.logits_soft_cap is not None:
            reasons.append("attention sinks with a logits soft-cap not supported (FlashInfer's "
                           "sink variant has no soft-cap)")
        return reasons
