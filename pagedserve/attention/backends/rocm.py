"""ROCM backend: the TRITON backend plus AMD's `aiter` paged-attention kernel for decode steps.

On a ROCm build of torch (`torch.version.hip`) with `aiter` importable, an all-decode step whose
shape aiter's `paged_attention_v1` takes (fp16/bf16, head size 64 or 128, block size 16 or 32, no
sliding window; the cache in our NHD layout [num_blocks, block_size, Hkv, D]) runs that kernel;
every other step, and every step without aiter, runs the Triton kernels of the TRITON backend
(Triton compiles for AMD GPUs too). On CUDA, or on the CPU under TRITON_INTERPRET=1, the backend
can be chosen by name and runs the Triton path only, which is how its code is tested.

What has run where: the Triton path passed the conformance suite in the Triton interpreter on
the CPU. Nothing of this backend has run on AMD hardware: no AMD machine was available. The aiter
call follows the argument order of aiter's public `paged_attention_v1` as used by other serving
engines; it is unverified here, and it is the first thing to test on an MI300.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from pagedserve import envs
from pagedserve.attention.backend import (
    BuilderConfig,
)
from pagedserve.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from pagedserve.attention.metadata import CommonAttentionMetadata

AITER_PARTITION_SIZE = 256
AITER_HEAD_SIZES = (64, 128)
AITER_BLOCK_SIZES = (16, 32)
AITER_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def aiter_importable() -> bool:
    return bool(torch.version.hip) and importlib.util.find_spec("aiter") is not None


def aiter_supports(config: BuilderConfig) -> bool:
    return (aiter_importable() and config.head_size in AITER_HEAD_SIZES
            and config.block_size in AITER_BLOCK_SIZES and config.dtype in AITER_DTYPES
            and config.sliding_window is None and config.kv_cache_dtype == "auto")


@dataclass
class RocmAttentionMetadata(TritonAttentionMetadata):
    use_aiter: bool = False  # this step is all decodes and aiter runs them
    workspace: torch.Tensor | None = None  # aiter's persistent scratch
    unit_scale: torch.Tensor | None = None  # K/V scale 1.0 (the cache is not quantized)


class RocmAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    def __init__(self, config: BuilderConfig) -> None:
        super().__init__(config)
        self.aiter = aiter_supports(config)
        self.workspace = self.unit_scale = None
        if self.aiter:
            # aiter's split-K scratch: partial outputs, then max logits and exp sums (fp32).
            max_seq = config.max_blocks_per_seq * config.block_size
            parts = -(-max_seq // AITER_PARTITION_SIZE)
            rows = config.max_num_reqs * config.num_heads * parts
            elem = torch.finfo(config.dtype).bits // 8
            self.workspace = torch.empty(rows * config.head_size * elem + 2 * rows * 4,
                                         dtype=torch.uint8, device=config.device)
            self.unit_scale = torch.ones(1, dtype=torch.float32, device=config.device)

    def build(self, common: CommonAttentionMetadata) -> RocmAttentionMetadata:
        md = super().build(common)
        fields = {name: getattr(md, name) for name in md.__dataclass_fields__}
        return RocmAttentionMetadata(**fields, use_aiter=self.aiter and common.max_query_len <= 1,
                                     workspace=self.workspace, unit_scale=self.unit_scale)


class RocmAttentionImpl(TritonAttentionImpl):
    # aiter's paged_attention_v1 takes no sink logits: a sink layer would need its decodes kept
    # on the Triton path, which has not run on AMD hardware; until then ROCM refuses sinks.
    supports_sinks = False
    # Nor does it take a value head size of its own, and the Triton path's support for one has
    # not run on AMD hardware either: ROCM refuses such layers (TRITON runs them).
    supports_diff_kv = False

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, output: torch.Tensor,
                md: RocmAttentionMetadata) -> None:
        if not md.use_aiter:
            super()._attend(query, key, value, k_cache, v_cache, output, md)
            return
        import aiter

        from pagedserve.attention.ops.reshape_and_cache import reshape_and_cache

        reshape_and_cache(key, value, k_cache, v_cache, md.common.slot_mapping)

        common = md.common
        n = common.num_actual_tokens
        aiter.paged_attention_v1(
            output[:n], md.workspace, query[:n], k_cache, v_cache, self.scale,
            common.block_table, common.query_start_loc, common.seq_lens, common.max_seq_len,
            None, "auto", "NHD", self.logits_soft_cap or 0.0, md.unit_scale, md.unit_scale,
            None, AITER_PARTITION_SIZE)


class RocmAttentionBackend(TritonAttentionBackend):
    name = "ROCM"
    supports_sinks = False  # see RocmAttentionImpl
    supports_diff_kv = False  # see RocmAttentionImpl
    # The Triton path honours attend_limit, but it has not run on AMD hardware with it.
    supports_bidirectional_spans = False
    # Verify steps would run the Triton path, whose graphs have not run on AMD hardware.
    supports_uniform_query_graphs = False
    description = "aiter paged attention for decodes on ROCm, Triton kernels otherwise"

    impl_cls = RocmAttentionImpl
    builder_cls = RocmAttentionMetadataBuilder
    metadata_cls = RocmAttentionMetadata

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        ok, why = super().is_available()
        if not ok:
            return ok, why
        if torch.version.hip:
            if aiter_importable():
                return True, "aiter paged attention for decodes, Triton kernels otherwise"
            return True, "Triton kernels (aiter is not importable: pip install aiter for decodes)"
        if envs.TRITON_INTERPRET and not torch.cuda.is_available():
            return True, "Triton path only, in the Triton interpreter on CPU (testing only)"
        return True, "not a ROCm build of torch: runs the Triton path only (for testing)"
