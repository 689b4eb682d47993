"""FLASHINFER_MLA: multi-head latent attention on FlashInfer's `BatchMLAPagedAttentionWrapper`,
in the weight-absorbed form for every token (decodes and prefills alike).

Per layer and step: q_lat = q_nope @ W_UK (one batched matmul over the heads), the step's latent
rows into the cache (TRITON_MLA's write kernel), one FlashInfer run over the latent cache with
the query as the pair (q_lat, q_pe), then output = out_lat @ W_UV^T.

Cache: the same [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] buffer as CPU_MLA and
TRITON_MLA. The wrapper takes it whole as a "packed" cache and hands its FA kernels the c and
k_pe parts as strided views (they read a page stride and a token stride for each), so there is
one buffer, not a ckv and a kpe buffer apart.

Planning. The builder plans once per step on the host, for the whole step at once: CSR metadata
(qo_indptr = query_start_loc, kv_indptr / kv_indices = the step's page CSR, kv_len = seq_lens)
from the common metadata's host mirrors (FlashInfer's plan reads the page ids' range; from the
device copy that would wait for the GPU), causal (a decode's one query sees every key either
way), the layer's softmax scale (the plan bakes it in, so the builder config carries it). On
Hopper FlashInfer's "auto" policy plans its fa3 kernel, else fa2; both need the query dtype
(fp16/bf16, no float32) to be the cache's, kv_lora_rank a multiple of 128 (fa3: 128, 256 or 512)
and qk_rope_head_dim a multiple of 64. A plan FlashInfer refuses for a step's shape (its
causal tile-boundary check, its work-item capacity of very large prefills) is not fatal: that
step's prefills then run through TRITON_MLA's expanded prefill and only its decodes through
FlashInfer (logged once).

CUDA graphs. Decode steps replay graphs: one wrapper per captured batch size, built with
use_cuda_graph=True over reserved indptr / indices / kv_len buffers that every size's wrapper
views, and re-planned (FlashInfer's FA backends allow re-planning a graph wrapper; its int
workspace then stays the same) from the padded step before each replay. `flashinfer` is
imported lazily.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.attention.backend import (
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    BuilderConfig,
)
from pagedserve.attention.backends.cpu_mla import CPUMLABackend
from pagedserve.attention.backends.flashinfer import import_flashinfer
from pagedserve.attention.backends.triton_mla import (
    EXPAND_BUDGET_BYTES,
    ExpandedPrefill,
    ExpandedPrefillPlanner,
    expanded_prefill_bytes,
    run_expanded_prefill,
)
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.mla import MLAImpl

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20


@dataclass
class FlashInferMLAMetadata:
    """One step (or one CUDA-graph size) of one layer configuration."""

    num_tokens: int  # the step's tokens (a graph: its padded size)
    slot_mapping: torch.Tensor  # [num_tokens]; -1 = no write (graph padding)
    # Planned for tokens [token_start, num_tokens); None when there are none.
    wrapper: Any
    token_start: int = 0
    # The step's prefills through TRITON_MLA's expanded path, when FlashInfer refused them.
    prefill: ExpandedPrefill | None = None


def csr_args(common: CommonAttentionMetadata, first: int = 0) -> tuple[torch.Tensor, ...]:
    """(qo_indptr, kv_indptr, kv_indices, kv_len) of requests [first, num_reqs) on the host,
    int32, indptrs rebased to 0: the wrapper's CSR metadata."""
    b = common.num_reqs
    qo = common.query_start_loc_cpu[first:b + 1]
    kv = common.paged_kv_indptr_cpu[first:b + 1]
    indices = common.paged_kv_indices_cpu
    if indices is None:
        raise ValueError("FLASHINFER_MLA plans from the page ids' host mirror")
    indices = indices[int(kv[0]):int(kv[-1])]
    if first:
        qo, kv = qo - qo[0], kv - kv[0]
    return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
                 for a in (qo, kv, indices, common.seq_lens_cpu[first:b]))


class FlashInferMLAMetadataBuilder(AttentionMetadataBuilder):
    # FlashInfer's MLA kernel family ("auto" lets it choose: fa3 on Hopper); the MLA decode
    # benchmark sets "fa2"/"fa3" to compare them.
    kernel_backend = "auto"

    def __init__(self, config: BuilderConfig) -> None:
        super().__init__(config)
        import flashinfer

        self._flashinfer = flashinfer
        self.device = torch.device(config.device)
        if config.mla_dims is None or config.softmax_scale is None:
            raise ValueError("FLASHINFER_MLA builds for multi-head latent attention layers")
        self.lora, _, self.rope, _ = config.mla_dims
        # One workspace for every wrapper of this builder: it holds a run's transient split-KV
        # partials only, and runs are serialised on the stream.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = self._new_wrapper()
        self.prefill_planner = ExpandedPrefillPlanner(config, self.device)
        self._refusal = _plan_refusal_type()
        self._refusal_logged = False
        self._graphs: dict[int, FlashInferMLAMetadata] = {}
        self._graph_buffers: dict[str, torch.Tensor] | None = None

    def _new_wrapper(self, **graph_buffers: torch.Tensor) -> Any:
        return self._flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=bool(graph_buffers), backend=self.kernel_backend,
            **graph_buffers)

    def _plan(self, wrapper: Any, csr: tuple[torch.Tensor, ...]) -> None:
        c = self.config
        qo_indptr, kv_indptr, kv_indices, kv_len = csr
        wrapper.plan(
            metadata=self._flashinfer.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices,
                                                              kv_len),
            num_heads=c.num_heads, head_dim_ckv=self.lora, head_dim_kpe=self.rope,
            page_size=c.block_size, causal=True, sm_scale=c.softmax_scale,
            q_data_type=c.dtype, kv_data_type=c.dtype, query_layout="split",
            kv_cache_layout="packed")

    def build(self, common: CommonAttentionMetadata) -> FlashInferMLAMetadata:
        n = common.num_actual_tokens
        slots = common.slot_mapping[:n]
        if n == 0:
            return FlashInferMLAMetadata(0, slots, None)
        try:
            self._plan(self.wrapper, csr_args(common))
            return FlashInferMLAMetadata(n, slots, self.wrapper)
        except self._refusal as exc:  # FlashInfer's kernels refuse this step's shape
            if not common.num_prefills:
                raise
            return self._build_split(common, exc)

    def _build_split(self, common: CommonAttentionMetadata,
                     refusal: ValueError) -> FlashInferMLAMetadata:
        """The prefills expanded through TRITON_MLA's path, the decodes through FlashInfer."""
        if expanded_prefill_bytes(common, self.config) > EXPAND_BUDGET_BYTES:
            raise RuntimeError(f"FlashInfer refused the step ({refusal}) and its prefills "
                               "exceed the expanded-prefill budget") from refusal
        if not self._refusal_logged:
            logger.info("FLASHINFER_MLA: FlashInfer refused a step with prefills (%s); such "
                        "steps run their prefills expanded through Triton", refusal)
            self._refusal_logged = True
        p, tp = common.num_prefills, common.num_prefill_tokens
        wrapper = None
        if common.num_reqs > p:
            self._plan(self.wrapper, csr_args(common, p))
            wrapper = self.wrapper
        return FlashInferMLAMetadata(common.num_actual_tokens,
                                     common.slot_mapping[:common.num_actual_tokens], wrapper,
                                     token_start=tp, prefill=self.prefill_planner.plan(common))

    def build_for_cudagraph(self, common: CommonAttentionMetadata, num_reqs_padded: int,
                            padded: CommonAttentionMetadata | None = None
                            ) -> FlashInferMLAMetadata:
        """The padded decode step (`padded`: padding requests of one token at page 0, slot -1)
        planned into the size's graph wrapper; the same object every call for a size."""
        if padded is None or padded.num_prefills or padded.num_reqs != num_reqs_padded:
            raise ValueError(f"a CUDA-graph step is a padded decode step of {num_reqs_padded} "
                             "requests")
        md = self._graphs.get(num_reqs_padded) or self._new_graph(num_reqs_padded)
        self._plan(md.wrapper, csr_args(padded))
        # The padded step's slots: the common builder's persistent buffer (padding slots -1),
        # the same memory at every call for this size.
        md.slot_mapping = padded.slot_mapping[:num_reqs_padded]
        return md

    def _new_graph(self, size: int) -> FlashInferMLAMetadata:
        c = self.config
        if self._graph_buffers is None:
            r = c.max_num_reqs
            self._graph_buffers = {
                name: torch.zeros(n, dtype=torch.int32, device=self.device)
                for name, n in (("qo_indptr", r + 1), ("kv_indptr", r + 1),
                                ("kv_indices", r * c.max_blocks_per_seq), ("kv_len", r))}
        bufs = self._graph_buffers
        # Every size's wrapper views the same buffers: one graph replays per step, re-planned
        # just before.
        wrapper = self._new_wrapper(qo_indptr=bufs["qo_indptr"][:size + 1],
                                    kv_indptr=bufs["kv_indptr"][:size + 1],
                                    kv_indices=bufs["kv_indices"],
                                    kv_len_arr=bufs["kv_len"][:size])
        md = FlashInferMLAMetadata(size, torch.empty(0, dtype=torch.int64), wrapper)
        self._graphs[size] = md
        return md

def _plan_refusal_type() -> type[Exception]:
    """What FlashInfer's MLA planner raises when its kernels cannot run a step's shape (a
    ValueError subclass, kept apart from its errors about malformed metadata, which must not
    be caught); ValueError where the version names it otherwise."""
    try:
        from flashinfer.mla._batch_mla._backends._capabilities import (
            _BackendPlanUnsupportedError,
        )
    except ImportError:
        return ValueError
    return _BackendPlanUnsupportedError


class FlashInferMLAImpl(MLAImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: FlashInferMLAMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        from pagedserve.attention.ops.mla_decode import write_latents

        md = attn_metadata
        n = md.num_tokens
        write_latents(key[:n, 0], kv_cache, md.slot_mapping)
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.v_head_dim)
        if md.prefill is not None:
            tp = md.prefill.num_tokens
            run_expanded_prefill(self, query[:tp], kv_cache, output[:tp], md.prefill)
        if md.wrapper is not None:
            s = md.token_start
            output[s:n] = self._absorbed(query[s:n], kv_cache, md.wrapper)
        return output

    def _absorbed(self, query: torch.Tensor, kv_cache: torch.Tensor,
                  wrapper: Any) -> torch.Tensor:
        w_uk, w_uv = self.up_projections()
        q_nope, q_pe = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # [H, T, nope] @ [H, nope, L]: every head's absorbed query in one batched matmul; the
        # kernel takes (q_lat, q_pe) with their own token and head strides.
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(query.dtype)).transpose(0, 1)
        out_lat = query.new_empty(query.shape[0], self.num_heads, self.kv_lora_rank)
        wrapper.run(query=(q_lat, q_pe), kv_cache=kv_cache, out=out_lat)
        # [H, T, L] @ [H, L, v]: back from latent space to each head's values.
        out = torch.bmm(out_lat.transpose(0, 1), w_uv.to(query.dtype).transpose(1, 2))
        return out.transpose(0, 1)


class FlashInferMLABackend(CPUMLABackend):
    """CPU_MLA's cache layout and layer checks; FlashInfer's MLA kernels."""

    name = "FLASHINFER_MLA"
    reads_paged_kv_indices = True
    supported_dtypes = (torch.float16, torch.bfloat16)  # FlashInfer's FA MLA kernels
    supports_cuda_graphs = True
    description = "FlashInfer's MLA paged wrapper (fa3/fa2), weight-absorbed, latent cache"

    impl_cls = FlashInferMLAImpl
    builder_cls = FlashInferMLAMetadataBuilder
    metadata_cls = FlashInferMLAMetadata

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        flashinfer, why_not = import_flashinfer("mla")
        if flashinfer is None:
            return False, why_not
        missing = [name for name in ("BatchMLAPagedAttentionWrapper", "MLAPlanMetadata")
                   if not hasattr(flashinfer.mla, name)]
        if missing:
            return False, (f"FlashInfer {flashinfer.__version__} has no "
                           f"flashinfer.mla.{' / '.join(missing)} (this backend is written "
                           "against 0.7.4's planned MLA wrapper)")
        return True, f"FlashInfer {flashinfer.__version__} BatchMLAPagedAttentionWrapper"

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        reasons = super().validate_configuration(layer, block_size, device)
        if reasons:
            return reasons
        if device.type != "cuda":
            reasons.append(f"FlashInfer runs on CUDA devices, not {device.type}")
        lora, _, rope, _ = layer.mla_dims  # type: ignore[attr-defined]
        if lora % 128 or rope % 64:
            reasons.append(f"kv_lora_rank {lora} / qk_rope_head_dim {rope}: FlashInfer's MLA "
                           "kernels need multiples of 128 / 64")
        return reasons
