"""TRITON backend: our own Triton kernels over the paged cache (attention/ops/).

Per step the builder does all host work once for every layer: it picks the launch shape (decode
tiles for an all-decode step, prefill tiles otherwise), builds the query-block map (request and
first token of every BLOCK_Q-token block), chooses the split-KV factor for small decode batches
and copies the map into persistent device buffers. Each layer's forward is then one launch
with no host sync (two for split decodes: the merge kernel): unified_attention writes the
step's K/V into the cache itself and reads the new keys from the key/value inputs. Cache
layout [2, num_blocks, block_size, num_kv_heads, head_size] (as CPU's); a layer whose values
have their own head size (head_size_v) takes the base class's side-by-side layout, whose K and
V views share strides, so the kernels read both through one set of strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve import envs
from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    BuilderConfig,
)
from pagedserve.attention.encoder import EncoderMetadata
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.ops.query_blocks import QueryBlockMap

MAX_BLOCK_SIZE = 1024  # tiles read pages through the block table one key at a time: any size


@dataclass
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    qblock_req: torch.Tensor  # [num_qblocks] int32, request of each query block
    qblock_start: torch.Tensor  # [num_qblocks] int32, its first token within the request
    num_qblocks: int
    block_q: int
    block_m: int
    tiles: object  # ops.unified_attention.TileConfig
    num_splits: int  # > 1: split-KV decode through `partials`
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, config: BuilderConfig) -> None:
        super().__init__(config)
        from pagedserve.attention.ops.decode_split_kv import (
            MAX_SPLITS,
            allocate_partials,
            device_sm_count,
            max_split_decodes,
        )

        device = torch.device(config.device)
        self.device = device
        self.num_queries_per_kv = config.num_heads // config.num_kv_heads
        self.num_sms = device_sm_count(device)
        self.query_blocks = QueryBlockMap(config.max_num_tokens, device)
        self.max_split_tokens = max_split_decodes(config.max_num_reqs, config.num_kv_heads,
                                                  self.num_sms)
        self.partials = (allocate_partials(self.max_split_tokens, config.num_heads,
                                           config.value_head_size, MAX_SPLITS, device)
                         if self.max_split_tokens else None)

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        from pagedserve.attention.ops.decode_split_kv import choose_num_splits
        from pagedserve.attention.ops.unified_attention import query_block_shape, select_tiles

        c = self.config
        b = common.num_reqs
        decode_only = common.max_query_len <= 1
        tiles = select_tiles(self.device, c.head_size, c.dtype, decode_only, c.value_head_size)
        block_q, block_m = query_block_shape(self.num_queries_per_kv, tiles, decode_only)
        num_qblocks = self.query_blocks.fill(common, block_q)

        num_splits = 1
        if decode_only and b <= self.max_split_tokens:
            num_splits = choose_num_splits(b, c.num_kv_heads, common.max_seq_len, self.num_sms,
                                           tiles.block_n)
        return TritonAttentionMetadata(
            common=common, qblock_req=self.query_blocks.req,
            qblock_start=self.query_blocks.start,
            num_qblocks=num_qblocks, block_q=block_q, block_m=block_m, tiles=tiles,
            num_splits=num_splits, partials=self.partials if num_splits > 1 else None)


class TritonAttentionImpl(AttentionImpl):
    supports_sinks = True
    supports_diff_kv = True
    supports_encoder_only = True

    def forward_encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_metadata: EncoderMetadata,
                        output: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder-only layers: one varlen launch over the packed Q/K/V (ops/varlen_attention)."""
        from pagedserve.attention.ops.varlen_attention import varlen_attention

        md = attn_metadata
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.value_head_size)
        return varlen_attention(query, key, value, output, md.cu_seqlens, md.num_reqs,
                                md.max_seqlen, self.scale, window=self.sliding_window)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TritonAttentionMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        from pagedserve.attention.ops.reshape_and_cache import reshape_and_cache

        md = attn_metadata
        k_cache, v_cache = TritonAttentionBackend.kv_cache_views(kv_cache, self.layer.head_size_v)
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.value_head_size)
        if md.num_qblocks == 0:  # nothing to attend, but the cache still takes the K/V
            reshape_and_cache(key, value, k_cache, v_cache, md.common.slot_mapping,
                              **self._cache_scales(k_cache, query))
            return output
        self._attend(query, key, value, k_cache, v_cache, output, md)
        return output

    def _cache_scales(self, k_cache: torch.Tensor, query: torch.Tensor) -> dict[str, float]:
        """The K/V scales of an fp8 cache; a cache in the model dtype holds K/V as they are."""
        if k_cache.dtype == query.dtype:
            return {}
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, output: torch.Tensor,
                md: TritonAttentionMetadata) -> None:
        """One launch (two for a split decode) that also writes the step's K/V into the
        cache and reads the new keys from key/value; in a step where a request's context holds
        blocks the same step writes, the write goes first and attention reads the pages."""
        from pagedserve.attention.ops.decode_split_kv import split_kv_decode
        from pagedserve.attention.ops.unified_attention import unified_attention

        common = md.common
        sinks = self.bound_sinks()
        new_kv = dict(key=key, value=value, slot_mapping=common.slot_mapping)
        scales = self._cache_scales(k_cache, query)
        if common.context_written_in_step or scales:
            # Some request reads as context blocks this step writes (a same-step prefix-cache
            # hit): the fused write would race with those reads, so write first. An fp8 cache
            # is written first too, scaled, so that every key is read back as stored.
            from pagedserve.attention.ops.reshape_and_cache import reshape_and_cache

            reshape_and_cache(key, value, k_cache, v_cache, common.slot_mapping, **scales)
            new_kv = {}
        scale = self.scale * scales.get("k_scale", 1.0)
        v_scale = scales.get("v_scale", 1.0)
        if md.num_splits > 1:
            split_kv_decode(query, k_cache, v_cache, output, common.block_table,
                            common.query_start_loc, common.seq_lens, md.qblock_req,
                            md.qblock_start, md.num_qblocks, md.block_m, scale, md.tiles,
                            md.num_splits, md.partials, self.sliding_window,
                            self.logits_soft_cap, sinks=sinks, v_scale=v_scale, **new_kv)
            return
        unified_attention(query, k_cache, v_cache, output, common.block_table,
                          common.query_start_loc, common.seq_lens, md.qblock_req,
                          md.qblock_start, md.num_qblocks, md.block_q, md.block_m, scale,
                          md.tiles, self.sliding_window, self.logits_soft_cap, sinks=sinks,
                          v_scale=v_scale, attend_limit=common.attend_limit, **new_kv)


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON"
    # Any size works (tiles pad the head to a power of two and mask); these are the tested ones.
    # 192: DeepSeek's expanded MLA prefill and MiMo-V2-Flash (queries/keys; values 128).
    supported_head_sizes = (64, 80, 96, 128, 192, 256)
    supports_sliding_window = True
    supports_soft_cap = True
    supports_sinks = True
    supports_diff_kv = True
    supports_cuda_graphs = True
    # A uniform step of q > 1 tokens a request builds prefill tiles, size x ceil(q / BLOCK_Q)
    # query blocks (a fixed grid per padded size) and never splits KV (decodes only): its
    # launches read nothing else of the step from the host.
    supports_uniform_query_graphs = True
    # fp8: e4m3 pages with per-tensor scales, written before the kernel reads them back.
    supported_kv_cache_dtypes = ("auto", "fp8")
    supports_encoder_only = True
    supports_encoder_window = True
    encoder_takes_any_head_size = True  # ops/varlen_attention pads and masks the head
    # Image spans that attend both ways: the prefill mask reads the step's attend_limit.
    supports_bidirectional_spans = True
    description = "Triton unified paged attention (one launch per step) + split-KV decode"

    impl_cls = TritonAttentionImpl
    builder_cls = TritonAttentionMetadataBuilder
    metadata_cls = TritonAttentionMetadata

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        try:
            import triton
        except ImportError as exc:
            return False, f"triton is not importable ({exc}); pip install triton"
        if torch.cuda.is_available():
            where = "ROCm" if torch.version.hip else "CUDA"
            return True, f"Triton {triton.__version__} kernels on {where}"
        if envs.TRITON_INTERPRET:
            return True, "Triton interpreter on CPU (testing only)"
        return False, ("no GPU; set TRITON_INTERPRET=1 to run the kernels in the Triton "
                       "interpreter on the CPU (testing only)")

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        reasons = super().validate_configuration(layer, block_size, device)
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            reasons.append(f"block size {block_size} not in 1..{MAX_BLOCK_SIZE}")
        if device.type == "cpu" and not envs.TRITON_INTERPRET:
            reasons.append("CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
        return reasons
