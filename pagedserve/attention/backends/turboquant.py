"""TURBOQUANT backend: a rotated low-bit quantized KV cache (TurboQuant, Zandieh et al.).

Each new K/V vector is rotated by a fixed randomized Hadamard transform, its coordinates are
quantized with the Lloyd-Max codebook of N(0, 1) and packed, with the vector's norm kept as
fp16 metadata (format, presets and the cache layout: ops/turboquant_format.py). Each (block, KV
head) of the cache holds its tokens as a structure of arrays: all K code rows, all V code rows,
then the K and V metas, so code rows stay 16-byte aligned for vector loads. Attention scores
rotated queries against the dequantized rotated keys and rotates the output back once; the
step's own new tokens are attended at full precision. Presets (`kv_cache_dtype`): tq_k8v4,
tq_4bit (= "auto"), tq_3bit, and the unrotated comparison presets naive_int4, naive_int3.

The cache layout depends on the preset, but `get_kv_cache_shape` takes none: the engine binds
one with `TurboQuantBackend.for_kv_cache_dtype(kv_cache_dtype)`, a subclass whose shape, dtype
and page size are those of that preset (the unbound class stands for the default preset and
refuses to size a cache for another one).

On CUDA the builder plans the kernels once per step and each layer only launches them
(ops/turboquant_kernels.py): one fused rotate-quantize-pack store of the step's K/V, then
  - a decode-only step: one decode launch, the CUDA kernel for the rotated presets at head
    sizes 64 and 128 (ops/tq_decode_cuda.py, built with nvcc when the builder starts;
    PAGEDSERVE_TQ_DECODE_KERNEL) or the Triton kernel at decode tiles, split-KV for small
    batches;
  - a step with prefills: the prefills' queries over their own new keys at full precision
    through TRITON's dense unified kernel (a first chunk needs nothing else: no page is
    dequantized), which also leaves each row's log-sum-exp; the prefills that continue
    earlier pages then attend those pages alone through the TurboQuant kernel, which merges
    its softmax into the dense one (log-sum-exp weights); the step's decodes run as a decode
    launch of their own, not at prefill tiles.
Decode steps replay CUDA graphs (engine/cuda_graphs.py): every launch reads its sizes from the
padded batch and its data from buffers of fixed address, the split count is fixed per
captured size for the engine's longest sequence (`build_for_cudagraph`; the kernels cut each
request's context into the splits on the device), padding requests (context 0, slot -1)
attend their own token and write nothing, and the CUDA kernel is built before any capture.
Elsewhere the builder builds the CPU backend's padded groups and the impl runs the plain torch
format, dequantizing the pages it gathers.

Longer than 500 lines: the backend's layout hooks, the builder's three launch plans and the
impl's kernel and torch paths share the plan dataclasses; split, each part would import the
others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    BuilderConfig,
    diff_kv_reason,
)
from pagedserve.attention.backends.cpu import AttentionGroup, CPUAttentionMetadataBuilder
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.ops import turboquant_format as tqf
from pagedserve.attention.ops.query_blocks import QueryBlockMap

MAX_KERNEL_HEAD_SIZE = 128


@dataclass
class KernelPlan:
    """Launch plan of one TurboQuant attention launch (Triton, or the CUDA decode kernel)."""

    qblock_req: torch.Tensor  # [num_qblocks] int32
    qblock_start: torch.Tensor  # [num_qblocks] int32
    num_qblocks: int
    block_q: int
    block_m: int
    tiles: object  # ops.turboquant_kernels.TQTiles
    num_splits: int = 1  # > 1: split-KV decode through `partials`
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # A decode launch may run the CUDA kernel (ops.tq_decode_cuda): 'auto' where the layer
    # allows it, 'cuda' (or fail), 'triton'.
    decode_kernel: str = "triton"


@dataclass
class PrefillPlan:
    """A step with prefills: the prefills' new tokens attend each other at full precision
    through the dense unified kernel (which also leaves each row's log-sum-exp), the prefills
    that continue a context then attend their quantized pages alone and merge into that
    (`context`, None when no prefill has context), and the step's decodes run as a decode
    launch of their own (`decodes`, None when there are none)."""

    dense_req: torch.Tensor  # unified_attention's query-block map over the prefills
    dense_start: torch.Tensor
    dense_qblocks: int
    dense_block_q: int
    dense_block_m: int
    dense_tiles: object  # ops.unified_attention.TileConfig
    new_lens: torch.Tensor  # [num_prefills] int32: each prefill's new tokens (seq_lens there)
    no_slots: torch.Tensor  # [>= T] int64 of -1: the dense kernel writes no cache
    lse: torch.Tensor  # [>= T, H] fp32
    no_cache: torch.Tensor  # [1, 1, Hkv, D]: the dense kernel's cache argument, never read
    context: KernelPlan | None
    decodes: KernelPlan | None


@dataclass
class TurboQuantMetadata:
    common: CommonAttentionMetadata
    kernel: KernelPlan | None = None  # set: a decode-only step on the kernels
    prefill: PrefillPlan | None = None  # set: a step with prefills on the kernels
    groups: list[AttentionGroup] | None = None  # set: the torch path
    # Per group: flat index of each new token in the group's [B * max_seq_len] key grid.
    new_key_index: list[torch.Tensor] | None = None


class TurboQuantMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, config: BuilderConfig) -> None:
        super().__init__(config)
        device = torch.device(config.device)
        self.device = device
        self.use_kernels = device.type == "cuda"  # tests may turn it on under the interpreter
        self.num_queries_per_kv = config.num_heads // config.num_kv_heads
        self._groups = CPUAttentionMetadataBuilder(config)
        # Query-block maps: the step's TurboQuant launch (a decode step; a prefill step's
        # context launch), the decodes of a mixed step, the prefills' dense launch.
        self.query_blocks = QueryBlockMap(config.max_num_tokens, device)
        self.decode_blocks = QueryBlockMap(config.max_num_reqs, device)
        self.dense_blocks = QueryBlockMap(config.max_num_tokens, device)
        # Launch shapes of the attention kernel (ops.turboquant_kernels.TQTiles); None: the
        # kernel module's defaults for the device. Benchmarks and tests set them to sweep.
        self.decode_tiles = None
        self.prefill_tiles = None
        # Split-KV decode (ops.decode_split_kv): None picks the split count per step
        # (`choose_num_splits`: only while decodes x KV heads leave SMs idle); tests set it.
        self.num_splits: int | None = None
        # Set by prepare_for_cudagraphs: graph steps take their split count from the padded
        # batch and this bound, never from the step (the captured grid is fixed).
        self.capture_max_seq_len: int | None = None
        # Decode-only steps: 'auto', 'cuda' or 'triton' (ops.tq_decode_cuda);
        # PAGEDSERVE_TQ_DECODE_KERNEL sets it, benchmarks and tests override it.
        from pagedserve.attention.ops.tq_decode_cuda import requested_kernel, unsupported_reason

        self.decode_kernel = requested_kernel()
        if device.type == "cuda" and self.decode_kernel != "triton":
            # Compile (first run) or load the CUDA kernel at start-up, not in the first decode
            # step (nor inside a graph capture), where the layer can use it (the impl checks
            # again per layer).
            unsupported_reason(tqf.get_preset(config.kv_cache_dtype), config.head_size,
                               config.block_size, config.dtype, self.num_queries_per_kv,
                               config.sliding_window, config.logits_soft_cap, device)
        from pagedserve.attention.ops.decode_split_kv import (
            MAX_SPLITS,
            device_sm_count,
            max_split_decodes,
        )

        self.num_sms = device_sm_count(device)
        self._partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._partials_size = (0, 0)
        split_decodes = max_split_decodes(config.max_num_reqs, config.num_kv_heads, self.num_sms)
        if split_decodes:
            self._split_partials(split_decodes, MAX_SPLITS)
        # The prefill path's persistent buffers (allocated lazily: the torch path needs none).
        self._new_lens: torch.Tensor | None = None
        self._no_slots: torch.Tensor | None = None
        self._no_cache: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None

    def build(self, common: CommonAttentionMetadata) -> TurboQuantMetadata:
        if self.use_kernels:
            if common.max_query_len <= 1:
                return TurboQuantMetadata(common, kernel=self._plan_decodes(
                    common, 0, common.num_reqs, self.query_blocks, common.max_seq_len))
            return TurboQuantMetadata(common, prefill=self._plan_prefills(common))
        groups = self._groups.build(common).groups
        return TurboQuantMetadata(common, groups=groups,
                                  new_key_index=[self._new_key_index(common, g, s)
                                                 for g, s in zip(groups, self._group_starts(
                                                     common), strict=True)])

    def prepare_for_cudagraphs(self, max_seq_len: int) -> None:
        self.capture_max_seq_len = max_seq_len
        if self.num_splits is not None and self.num_splits > 1:
            # A forced split count: its buffers at their largest before any capture.
            self._split_partials(self.config.max_num_reqs, self.num_splits)

    def build_for_cudagraph(self, common: CommonAttentionMetadata, num_reqs_padded: int,
                            padded: CommonAttentionMetadata | None = None) -> TurboQuantMetadata:
        """The padded decode step with launch bounds fixed per captured size: one program per
        padded request (block_q 1), and the split count chosen for the padded batch at the
        longest sequence the engine allows (prepare_for_cudagraphs), which the kernels cut
        on the device from each request's real length. Padding requests (context 0, slot -1)
        attend their own new token only and write nothing."""
        if padded is None:
            raise ValueError("TURBOQUANT builds graph metadata from the padded step")
        if not self.use_kernels:
            return self.build(padded)
        # The bound prepare_for_cudagraphs fixed (never the step's lengths: the captured grid
        # has that split count).
        bound = self.capture_max_seq_len or padded.max_seq_len
        return TurboQuantMetadata(padded, kernel=self._plan_decodes(
            padded, 0, padded.num_reqs, self.query_blocks, bound))

    @staticmethod
    def _group_starts(common: CommonAttentionMetadata) -> list[int]:
        starts = [0] if common.num_prefills else []
        return starts + ([common.num_prefills] if common.num_decodes else [])

    @staticmethod
    def _new_key_index(common: CommonAttentionMetadata, group: AttentionGroup,
                       first_req: int) -> torch.Tensor:
        req = group.token_index // group.max_query_len
        offset = group.token_index % group.max_query_len
        context = common.context_lens[first_req:].long()[req]
        return req * group.max_seq_len + context + offset

    def _plan_decodes(self, common: CommonAttentionMetadata, first: int, end: int,
                      blocks: QueryBlockMap, max_seq_len: int | None) -> KernelPlan:
        """Requests [first, end), one new token each: one program per (request, KV head
        [, split]). max_seq_len: the bound the split count is chosen for; None: no split."""
        from pagedserve.attention.ops.turboquant_kernels import select_tiles
        from pagedserve.attention.ops.unified_attention import query_block_shape

        tiles = self.decode_tiles or select_tiles(self.device, True)
        block_q, block_m = query_block_shape(self.num_queries_per_kv, tiles, True)
        num_qblocks = blocks.fill(common, block_q, first, end)
        num_splits = 1
        if max_seq_len is not None and num_qblocks:
            num_splits = self.num_splits
            if num_splits is None:
                from pagedserve.attention.ops.decode_split_kv import choose_num_splits

                num_splits = choose_num_splits(num_qblocks, self.config.num_kv_heads,
                                               max_seq_len, self.num_sms, tiles.block_n)
        partials = self._split_partials(num_qblocks, num_splits) if num_splits > 1 else None
        return KernelPlan(blocks.req, blocks.start, num_qblocks, block_q, block_m, tiles,
                          num_splits, partials, self.decode_kernel)

    def _plan_prefills(self, common: CommonAttentionMetadata) -> PrefillPlan:
        from pagedserve.attention.ops import unified_attention as ua
        from pagedserve.attention.ops.turboquant_kernels import select_tiles

        c, p, b = self.config, common.num_prefills, common.num_reqs
        self._prefill_buffers()
        qsl = common.query_start_loc_cpu[:p + 1]
        new_lens = np.diff(qsl).astype(np.int32)
        context = common.context_lens_cpu[:p]
        # Dense: the new tokens alone, as a prefill without context (seq_len = new tokens).
        dense_tiles = ua.select_tiles(self.device, c.head_size, c.dtype, False)
        dense_q, dense_m = ua.query_block_shape(self.num_queries_per_kv, dense_tiles, False)
        dense_qblocks = self.dense_blocks.fill_arrays(qsl, new_lens, dense_q)
        # On the device from query_start_loc (no host buffer to rewrite while a step in
        # flight may still be copying it).
        torch.sub(common.query_start_loc[1:p + 1], common.query_start_loc[:p],
                  out=self._new_lens[:p])
        # Context: the query blocks of the prefills that continue earlier pages (a request
        # without context gets no block).
        context_plan = None
        if context.any():
            tiles = self.prefill_tiles or select_tiles(self.device, False)
            block_q, block_m = ua.query_block_shape(self.num_queries_per_kv, tiles, False)
            with_context = np.where(context > 0, new_lens, 0)
            n = self.query_blocks.fill_arrays(
                np.concatenate([[0], np.cumsum(with_context)]), context + with_context, block_q)
            context_plan = KernelPlan(self.query_blocks.req, self.query_blocks.start, n,
                                      block_q, block_m, tiles)
        decodes = (self._plan_decodes(common, p, b, self.decode_blocks, None) if b > p
                   else None)
        return PrefillPlan(self.dense_blocks.req, self.dense_blocks.start, dense_qblocks,
                           dense_q, dense_m, dense_tiles, self._new_lens[:p],
                           self._no_slots, self._lse, self._no_cache, context_plan, decodes)

    def _prefill_buffers(self) -> None:
        if self._lse is not None:
            return
        c = self.config
        self._new_lens = torch.zeros(c.max_num_reqs, dtype=torch.int32, device=self.device)
        self._no_slots = torch.full((c.max_num_tokens,), -1, dtype=torch.int64,
                                    device=self.device)
        self._lse = torch.empty(c.max_num_tokens, c.num_heads, dtype=torch.float32,
                                device=self.device)
        self._no_cache = torch.zeros(1, 1, c.num_kv_heads, c.head_size, dtype=c.dtype,
                                     device=self.device)

    def _split_partials(self, num_tokens: int,
                        num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (m, l, acc) buffers of a split decode: allocated once for what the heuristic
        can ask (small decode batches), grown only for a larger forced num_splits."""
        from pagedserve.attention.ops.decode_split_kv import allocate_partials

        tokens, splits = self._partials_size
        if num_tokens > tokens or num_splits > splits:
            tokens, splits = max(num_tokens, tokens), max(num_splits, splits)
            self._partials = allocate_partials(tokens, self.config.num_heads,
                                               self.config.head_size, splits, self.device)
            self._partials_size = (tokens, splits)
        return self._partials


@functools.cache
def _format_tensors(preset_name: str, head_size: int, device: str) -> object:
    from pagedserve.attention.ops.turboquant_kernels import format_tensors

    return format_tensors(tqf.get_preset(preset_name), head_size, torch.device(device))


class TurboQuantImpl(AttentionImpl):
    def __init__(self, layer: AttentionLayerConfig) -> None:
        super().__init__(layer)
        self.preset = tqf.get_preset(layer.kv_cache_dtype)
        self._cuda_decode_reasons: dict[tuple, str | None] = {}
        self._slot_bytes = self.preset.slot_bytes(self.head_size)  # checked every forward
        self._tensors: dict[torch.device, object] = {}  # the preset's constants per device

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TurboQuantMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        slot_bytes = self._slot_bytes
        if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != slot_bytes:
            raise ValueError(
                f"{self.preset.name} needs a uint8 cache of {slot_bytes}-byte slots, got "
                f"{kv_cache.dtype} {tuple(kv_cache.shape)}: size it with "
                f"TurboQuantBackend.for_kv_cache_dtype({self.preset.name!r})")
        if output is None:
            output = torch.empty_like(query)
        if attn_metadata.kernel is not None or attn_metadata.prefill is not None:
            self._forward_kernels(query, key, value, kv_cache, attn_metadata, output)
        else:
            self._forward_torch(query, key, value, kv_cache, attn_metadata, output)
        return output

    # ---- Triton ---------------------------------------------------------------------------

    def _forward_kernels(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor, md: TurboQuantMetadata,
                         output: torch.Tensor) -> None:
        from pagedserve.attention.ops.turboquant_kernels import tq_attention, tq_store

        common = md.common
        tensors = self._tensors.get(query.device)
        if tensors is None:
            tensors = self._tensors[query.device] = _format_tensors(
                self.preset.name, self.head_size, str(query.device))
        # Every new token quantized into its slot in one pass; the attention launches below
        # read the step's own tokens from key/value, never back from the cache.
        tq_store(self.preset, tensors, key, value, kv_cache, common.slot_mapping)
        if md.kernel is not None:
            self._attend_decodes(query, key, value, kv_cache, common, md.kernel, tensors,
                                 output)
            return
        plan = md.prefill
        if plan.decodes is not None:
            self._attend_decodes(query, key, value, kv_cache, common, plan.decodes, tensors,
                                 output)
        self._attend_new_tokens(query, key, value, common, plan, output)
        ctx = plan.context
        if ctx is not None:
            tq_attention(self.preset, tensors, query, key, value, kv_cache, output,
                         common.block_table, common.query_start_loc, common.seq_lens,
                         ctx.qblock_req, ctx.qblock_start, ctx.num_qblocks, ctx.block_q,
                         ctx.block_m, self.scale, ctx.tiles, self.sliding_window,
                         self.logits_soft_cap, merge_lse=plan.lse)

    def _attend_new_tokens(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           common: CommonAttentionMetadata, plan: PrefillPlan,
                           output: torch.Tensor) -> None:
        """The prefills' queries over their own new keys at full precision, causally: the dense
        unified kernel (TRITON's), fed seq_lens = new tokens so that it sees no context and
        reads every key from key/value (slots -1: it writes no cache). It leaves each row's
        log-sum-exp for the context launch's merge."""
        from pagedserve.attention.ops.unified_attention import unified_attention

        unified_attention(query, plan.no_cache, plan.no_cache, output, common.block_table,
                          common.query_start_loc, plan.new_lens, plan.dense_req,
                          plan.dense_start, plan.dense_qblocks, plan.dense_block_q,
                          plan.dense_block_m, self.scale, plan.dense_tiles, self.sliding_window,
                          self.logits_soft_cap, key=key, value=value, slot_mapping=plan.no_slots,
                          lse=plan.lse)

    def _attend_decodes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        kv_cache: torch.Tensor, common: CommonAttentionMetadata,
                        plan: KernelPlan, tensors: object, output: torch.Tensor) -> None:
        """One new token per request of the plan's map: the CUDA decode kernel where it can
        run the layer, else the Triton kernel at decode tiles. Graph-safe: no host sync, no
        allocation (the CUDA library is built when the builder starts)."""
        from pagedserve.attention.ops.turboquant_kernels import tq_attention

        if plan.decode_kernel != "triton":
            reason = self._cuda_decode_reason(query, kv_cache)
            if reason is None:
                from pagedserve.attention.ops.tq_decode_cuda import tq_decode

                tq_decode(self.preset, tensors.signs, query, key, value, kv_cache, output,
                          common.block_table, common.query_start_loc, common.seq_lens,
                          plan.qblock_req, plan.num_qblocks, self.scale, plan.num_splits,
                          plan.partials)
                return
            if plan.decode_kernel == "cuda":
                raise RuntimeError(f"TURBOQUANT: the CUDA decode kernel was asked for but cannot "
                                   f"run this layer: {reason}")
        tq_attention(self.preset, tensors, query, key, value, kv_cache, output,
                     common.block_table, common.query_start_loc, common.seq_lens,
                     plan.qblock_req, plan.qblock_start, plan.num_qblocks, plan.block_q,
                     plan.block_m, self.scale, plan.tiles, self.sliding_window,
                     self.logits_soft_cap, num_splits=plan.num_splits, partials=plan.partials)

    def _cuda_decode_reason(self, query: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
        """Why the CUDA decode kernel cannot take this layer's decode steps (None: it can);
        the layer's part once per dtype, block size and device."""
        if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
            return "the cache's (block, KV head) regions are not 16-byte aligned"
        key = (query.dtype, kv_cache.shape[2], query.device)
        if key not in self._cuda_decode_reasons:
            from pagedserve.attention.ops.tq_decode_cuda import unsupported_reason

            self._cuda_decode_reasons[key] = unsupported_reason(
                self.preset, self.head_size, kv_cache.shape[2], query.dtype,
                self.num_heads // self.num_kv_heads, self.sliding_window,
                self.logits_soft_cap, query.device)
        return self._cuda_decode_reasons[key]

    # ---- torch ----------------------------------------------------------------------------

    def _forward_torch(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, md: TurboQuantMetadata,
                       output: torch.Tensor) -> None:
        n = md.common.num_actual_tokens
        tqf.store_kv(self.preset, kv_cache, key[:n], value[:n], md.common.slot_mapping[:n])
        for group, new_keys in zip(md.groups, md.new_key_index, strict=True):
            s, e = group.token_start, group.token_end
            output[s:e] = self._attend_group(query[s:e], key[s:e], value[s:e], kv_cache, group,
                                             new_keys).to(output.dtype)

    def _attend_group(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, group: AttentionGroup,
                      new_keys: torch.Tensor) -> torch.Tensor:
        """float32 attention in the storage domain: the group's context dequantized from its
        pages, its new tokens at full precision."""
        b = group.page_index.shape[0]
        h, d, hkv = self.num_heads, self.head_size, self.num_kv_heads
        max_k, max_q = group.max_seq_len, group.max_query_len
        # Pages [B, P, Hkv, bs, S] (plane layout) -> slot records -> [B, max_k, Hkv, S]
        pages = tqf.slot_records(self.preset, kv_cache[group.page_index], d)
        slots = pages.transpose(2, 3).flatten(1, 2)[:, :max_k]
        k, v = tqf.decode_kv(self.preset, slots, d)
        k = k.reshape(b * max_k, hkv, d).index_copy(
            0, new_keys, tqf.to_storage_domain(self.preset, key))
        v = v.reshape(b * max_k, hkv, d).index_copy(
            0, new_keys, tqf.to_storage_domain(self.preset, value))
        k = k.view(b, max_k, hkv, d).transpose(1, 2)
        v = v.view(b, max_k, hkv, d).transpose(1, 2)
        q = query.new_zeros(b * max_q, h, d, dtype=torch.float32)
        q[group.token_index] = tqf.to_storage_domain(self.preset, query)
        q = q.view(b, max_q, h, d).transpose(1, 2)
        if self.logits_soft_cap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=self.scale,
                                                 enable_gqa=hkv != h)
        else:
            out = _soft_capped_attention(q, k, v, group.mask, self.scale, self.logits_soft_cap)
        out = out.transpose(1, 2).reshape(b * max_q, h, d)[group.token_index]
        return tqf.from_storage_domain(self.preset, out)


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           scale: float, soft_cap: float) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask [B, 1, Lq, Lk]; float32."""
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    scores = torch.matmul(q.view(b, hkv, h // hkv, lq, d), k[:, :, None].transpose(-1, -2))
    scores = soft_cap * torch.tanh(scores * (scale / soft_cap))
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v[:, :, None])
    return out.view(b, h, lq, d)


class TurboQuantBackend(AttentionBackend):
    name = "TURBOQUANT"
    supported_head_sizes = (16, 32, 64, 128, 256)  # powers of two: the Hadamard rotation
    supported_kv_cache_dtypes = ("auto", *tqf.PRESETS)
    supports_sliding_window = True
    supports_soft_cap = True
    # Decode steps replay CUDA graphs: every launch of a decode step (the store, the Triton
    # attention or the CUDA decode kernel, the split merge) reads its sizes from the padded
    # batch and device buffers of fixed address, and the split count is fixed per captured
    # size (build_for_cudagraph); the CUDA kernel is built when the builder starts.
    supports_cuda_graphs = True
    description = ("rotated Lloyd-Max low-bit KV cache (TurboQuant), Triton and CUDA kernels on "
                   "CUDA, torch else")
    # Its cache is lossy: exact-tolerance conformance does not apply (its own tests check it
    # with tolerances derived from the preset).
    lossy_kv_cache: ClassVar[bool] = True
    kv_cache_preset: ClassVar[str] = tqf.DEFAULT_PRESET

    @classmethod
    def for_kv_cache_dtype(cls, kv_cache_dtype: str) -> type[TurboQuantBackend]:
        """This backend with its cache layout bound to a preset (kv_cache_dtype; "auto" is the
        default preset). The same class object for the same preset."""
        return _bound_backend(tqf.get_preset(kv_cache_dtype).name)

    @classmethod
    def preset(cls) -> tqf.KVPreset:
        return tqf.get_preset(cls.kv_cache_preset)

    impl_cls = TurboQuantImpl
    builder_cls = TurboQuantMetadataBuilder
    metadata_cls = TurboQuantMetadata

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, head_size_v: int | None = None) -> tuple[int, ...]:
        """uint8 [num_blocks, num_kv_heads, block_size, slot_bytes]: the real packed bytes. The
        block_size * slot_bytes bytes of a (block, KV head) hold K code rows, V code rows, K
        metas, V metas (structure of arrays, ops/turboquant_format.py), not slot records. The
        presets code K and V of one head size (one Hadamard rotation): supports_diff_kv is off."""
        if head_size_v is not None:
            raise ValueError(f"TURBOQUANT: {diff_kv_reason(head_size, head_size_v)}")
        return tqf.cache_shape(cls.preset(), num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def kv_cache_views(kv_cache: torch.Tensor,
                       head_size_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("the TurboQuant cache holds packed codes, not K/V views: "
                                  "read it with ops.turboquant_format.slot_records and "
                                  "decode_kv")

    @classmethod
    def get_kv_cache_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        wanted = tqf.get_preset(kv_cache_dtype)
        if wanted != cls.preset():
            raise ValueError(f"{cls.__name__} is laid out for {cls.kv_cache_preset}, not "
                             f"{wanted.name}: use TurboQuantBackend.for_kv_cache_dtype("
                             f"{kv_cache_dtype!r})")
        return torch.uint8

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        if torch.cuda.is_available() and not torch.version.hip:
            try:
                import triton
            except ImportError:
                return True, "torch format only (triton missing: pip install triton for kernels)"
            from pagedserve.attention.ops.tq_decode_cuda import nvcc_path

            decode = ("decode kernel built with nvcc" if nvcc_path()
                      else "no nvcc: Triton decodes too")
            return True, f"Triton {triton.__version__} kernels on CUDA; {decode}"
        return True, "plain torch format (dequantizes gathered pages); kernels need CUDA"

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        reasons = super().validate_configuration(layer, block_size, device)
        if layer.head_size & (layer.head_size - 1):
            reasons.append(f"head size {layer.head_size} is not a power of two (the Hadamard "
                           f"rotation needs one)")
        if device.type == "cuda":
            try:
                import triton  # noqa: F401
            except ImportError:
                reasons.append("CUDA tensors need triton for the TurboQuant kernels")
            if layer.head_size > MAX_KERNEL_HEAD_SIZE:
                # The kernels rotate with an fp32 [d, d] tl.dot operand: 256 KB at d = 256.
                reasons.append(f"head size {layer.head_size} > {MAX_KERNEL_HEAD_SIZE} is not "
                               f"supported by the TurboQuant kernels")
            preset = (cls.preset() if layer.kv_cache_dtype not in tqf.PRESETS
                      else tqf.PRESETS[layer.kv_cache_dtype])
            fp8 = "fp8" in (preset.key.kind, preset.value.kind)
            if fp8 and torch.cuda.get_device_capability(device) < (8, 9):
                # e4m3 conversions (PTX cvt ... e4m3x2) exist from sm_89 (Ada, Hopper) on
                reasons.append(f"{preset.name} stores fp8 e4m3 codes, which need a GPU of "
                               f"compute capability 8.9 or newer; choose tq_4bit or tq_3bit")
        return reasons


@functools.cache
def _bound_backend(preset_name: str) -> type[TurboQuantBackend]:
    return type(f"TurboQuantBackend_{preset_name}", (TurboQuantBackend,),
                {"kv_cache_preset": preset_name, "__module__": __name__})
