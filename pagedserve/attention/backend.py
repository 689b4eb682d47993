"""The attention backend interface: a backend class names its implementation, its metadata and
the builder that turns CommonAttentionMetadata into that metadata once per step.

Every hook the engine may call on a backend, its builder or its implementation is declared
here with its default; a backend overrides what it does differently. docs/architecture.md
says how a new backend plugs in.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedserve.attention.encoder import (
    DECODER,
    ENCODER_ONLY,
    EncoderMetadata,
    check_attn_type,
)
from pagedserve.attention.metadata import CommonAttentionMetadata

# Triton compiles a kernel anew for each class of its integer arguments (1, a multiple of 16,
# neither: token and row counts), at the variant's first launch. The memory profile runs one
# multiple of 16 and the decode graphs the decode sizes; these steps (prefill and chunked
# prefill of odd and even sizes, one request and several, eager decodes) compile the rest
# before the first request. Without them the 8B shape served at 4 req/s compiled for ~10 s
# inside its first requests (2026-12-02: TPOT 28 ms against 6 ms once compiled).
CUDA_WARMUP_STEPS = ((1, 17, 0), (2, 8, 0), (1, 17, 32), (3, 5, 21), (3, 1, 40), (16, 1, 40))


ENCODER_REASON = "encoder-only (bidirectional, no KV cache) attention not supported"
BIDIRECTIONAL_REASON = ("bidirectional image spans (each image's tokens attend both ways, as "
                        "Gemma 3's do) not supported")


def normalized_head_size_v(head_size: int, head_size_v: int | None) -> int | None:
    """The value head size as configs store it: None when it equals head_size, so one layer
    spelled both ways compares and hashes alike (and shares a builder and a cache layout)."""
    if head_size_v is not None and head_size_v < 1:
        raise ValueError(f"head_size_v must be >= 1, got {head_size_v}")
    return None if head_size_v == head_size else head_size_v


def diff_kv_reason(head_size: int, head_size_v: int) -> str:
    """The refusal of a backend (or impl) that needs K and V of one head size."""
    return f"value head size {head_size_v} != head size {head_size} not supported"


class _ValueHeadSize:
    """Shared by the layer and builder configs: `head_size_v` stored normalised (None when it
    equals head_size), `value_head_size` resolved."""

    head_size: int
    head_size_v: int | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_size_v",
                           normalized_head_size_v(self.head_size, self.head_size_v))
        check_attn_type(self.attn_type)

    @property
    def value_head_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v


@dataclass(frozen=True)
class AttentionLayerConfig(_ValueHeadSize):
    """What one attention layer asks of a backend."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None  # tokens a query sees, itself included
    logits_soft_cap: float | None = None
    kv_cache_dtype: str = "auto"
    scale: float | None = None  # softmax scale; None: head_size ** -0.5
    # A learned per-head logit joins each softmax as one more column that carries no value
    # (gpt-oss); the logits themselves are the layer's weights, bound to the impl (bind_sinks).
    has_sinks: bool = False
    # Values with their own head size (DeepSeek's expanded MLA prefill, MiMo-V2-Flash: 192 for
    # queries/keys, 128 for values); None (or head_size, stored as None): the same size.
    head_size_v: int | None = None
    # DECODER (causal over the cached context) or ENCODER_ONLY (bidirectional over the
    # request's own tokens, no cache kept): attention/encoder.py.
    attn_type: str = DECODER
    # The model's image tokens attend to each other both ways (Gemma 3): its steps may carry
    # `CommonAttentionMetadata.attend_limit`, which only backends with
    # `supports_bidirectional_spans` honour.
    bidirectional_spans: bool = False

    @property
    def softmax_scale(self) -> float:
        return self.head_size ** -0.5 if self.scale is None else self.scale


@dataclass(frozen=True)
class BuilderConfig(_ValueHeadSize):
    """Sizes a metadata builder allocates its persistent buffers for."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    max_num_reqs: int
    max_num_tokens: int
    max_blocks_per_seq: int
    device: torch.device
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    kv_cache_dtype: str = "auto"
    has_sinks: bool = False
    head_size_v: int | None = None  # as AttentionLayerConfig's
    # A multi-head latent attention layer's (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    # v_head_dim) (`MLALayerConfig.mla_dims`); None for other layers.
    mla_dims: tuple[int, int, int, int] | None = None
    # The layer's softmax scale (resolved), for builders that bake it into a plan.
    softmax_scale: float | None = None
    attn_type: str = DECODER  # as AttentionLayerConfig's: which build the step calls

    @classmethod
    def for_layer(cls, layer: AttentionLayerConfig, block_size: int, max_num_reqs: int,
                  max_num_tokens: int, max_blocks_per_seq: int,
                  device: torch.device) -> BuilderConfig:
        return cls(layer.num_heads, layer.num_kv_heads, layer.head_size, layer.dtype,
                   block_size, max_num_reqs, max_num_tokens, max_blocks_per_seq, device,
                   layer.sliding_window, layer.logits_soft_cap, layer.kv_cache_dtype,
                   layer.has_sinks, layer.head_size_v,
                   getattr(layer, "mla_dims", None), layer.softmax_scale, layer.attn_type)


class AttentionMetadataBuilder(ABC):
    """One per distinct layer configuration; its buffers are sized by `BuilderConfig`."""

    def __init__(self, config: BuilderConfig) -> None:
        self.config = config

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Host work once per step (plan); the result is handed to every layer's forward."""

    def build_encoder(self, common: CommonAttentionMetadata) -> Any:
        """The metadata of an encoder-only layer's step (every request whole, nothing cached),
        handed to the impl's `forward_encoder`. Default: the varlen form `EncoderMetadata`
        (cu_seqlens, longest sequence); a backend that plans per step overrides it."""
        return EncoderMetadata.from_common(common)

    def build_step(self, common: CommonAttentionMetadata) -> Any:
        """What the runner calls each step: `build_encoder` for an encoder-only layer
        configuration, else `build`."""
        if self.config.attn_type == ENCODER_ONLY:
            return self.build_encoder(common)
        return self.build(common)

    def build_for_cudagraph(self, common: CommonAttentionMetadata, num_reqs_padded: int,
                            padded: CommonAttentionMetadata | None = None) -> Any:
        """Metadata for a pure-decode step replayed as a CUDA graph captured at
        `num_reqs_padded` requests: `common` is the real step, `padded` the same step with
        padding requests appended (the common builder's `pad_decode`). What it returns must
        live in the same memory at every call for a given size (it is what the graph was
        captured with). Default: `build(padded)`, right for builders whose outputs are views
        of the common metadata's persistent buffers or of their own; a builder that pads on
        its own may ignore `padded`."""
        if padded is None:
            raise ValueError(f"{type(self).__name__} builds graph metadata from the padded step")
        return self.build(padded)

    def verify_graph_reason(self) -> str | None:
        """Why this configuration's verify steps (q > 1 tokens a request) may not be captured
        although its backend declares them (`AttentionBackend.can_capture_verify`), for the
        start-up log; None when they may. Default: None."""
        return None

    def prepare_for_cudagraphs(self, max_seq_len: int) -> None:
        """Called once before graphs are captured: launch bounds that depend on the step (a
        grid over the longest sequence, a split count) must then stay fixed across replays,
        sized for `max_seq_len`. Default: nothing depends on it."""
        return None

    def warmup(self) -> None:
        """Compile or JIT the kernels this configuration uses, at start-up rather than in the
        first request. Default: nothing to do."""
        return None


class AttentionImpl(ABC):
    """One per attention layer, built from the layer's configuration."""

    # Whether forward applies sinks bound through `bind_sinks`; an impl that does not is never
    # built for a sink layer, so it cannot run one while ignoring the sinks.
    supports_sinks: ClassVar[bool] = False
    # Whether forward handles values of another head size than queries/keys (output [T, H,
    # D_v]); an impl that does not is never built for such a layer.
    supports_diff_kv: ClassVar[bool] = False
    # Whether `forward_encoder` runs encoder-only layers; an impl that does not is never built
    # for one.
    supports_encoder_only: ClassVar[bool] = False

    def __init__(self, layer: AttentionLayerConfig) -> None:
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError(f"num_heads {layer.num_heads} is not a multiple of num_kv_heads "
                             f"{layer.num_kv_heads}")
        if layer.has_sinks and not self.supports_sinks:
            raise ValueError(f"{type(self).__name__}: attention sinks not supported")
        if layer.head_size_v is not None and not self.supports_diff_kv:
            raise ValueError(f"{type(self).__name__}: "
                             f"{diff_kv_reason(layer.head_size, layer.head_size_v)}")
        if layer.attn_type == ENCODER_ONLY and not self.supports_encoder_only:
            raise ValueError(f"{type(self).__name__}: {ENCODER_REASON}")
        self.layer = layer
        self.num_heads = layer.num_heads
        self.head_size = layer.head_size
        self.value_head_size = layer.value_head_size
        self.scale = layer.softmax_scale
        self.num_kv_heads = layer.num_kv_heads
        self.sliding_window = layer.sliding_window
        self.logits_soft_cap = layer.logits_soft_cap
        self.kv_cache_dtype = layer.kv_cache_dtype
        self.sinks: torch.Tensor | None = None
        # Per-tensor scales of an fp8 cache, which holds K / k_scale and V / v_scale (1.0 unless
        # the checkpoint carries them; `bind_kv_scales`). A cache in the model dtype ignores them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def bind_sinks(self, sinks: torch.Tensor) -> None:
        """The layer's sink logits [num_heads] (any float dtype, on the layer's device), bound
        once before the first forward (the Attention module does it in `bind`). The impl keeps
        the tensor itself, so weights loaded into it in place later are seen."""
        if not self.supports_sinks:
            raise ValueError(f"{type(self).__name__}: attention sinks not supported")
        if not self.layer.has_sinks:
            raise ValueError("sinks bound to a layer configured without them (has_sinks=False)")
        if tuple(sinks.shape) != (self.num_heads,):
            raise ValueError(f"sinks must have shape ({self.num_heads},), got "
                             f"{tuple(sinks.shape)}")
        self.sinks = sinks

    def bind_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """The checkpoint's per-tensor KV-cache scales (positive floats), bound by the Attention
        module before the first forward; an impl with an fp8 cache stores K / k_scale and
        V / v_scale and reads them back multiplied."""
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"KV-cache scales must be positive, got k_scale={k_scale}, "
                             f"v_scale={v_scale}")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    def bound_sinks(self) -> torch.Tensor | None:
        """The sinks forward applies: None for a layer without them; a sink layer whose sinks
        were never bound is an error rather than a run without them."""
        if self.layer.has_sinks and self.sinks is None:
            raise RuntimeError(f"{type(self).__name__}: a sink layer ran before bind_sinks")
        return self.sinks

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any,
                output: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, H, D], key [T, Hkv, D], value [T, Hkv, D_v] for the step's new tokens
        (D_v = the layer's value_head_size). Writes the new K/V into `kv_cache` through the slot
        mapping first, then attends (prefill, decode or mixed) and returns [T, H, D_v]."""

    def forward_encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_metadata: Any, output: torch.Tensor | None = None) -> torch.Tensor:
        """An encoder-only layer: query [T, H, D], key [T, Hkv, D], value [T, Hkv, D_v] of
        whole requests packed by `attn_metadata` (the builder's `build_encoder`), each token
        attending to every token of its own request; no cache is read or written. Returns
        [T, H, D_v]. Default: not supported (`supports_encoder_only` off)."""
        raise NotImplementedError(f"{type(self).__name__}: {ENCODER_REASON}")


class AttentionBackend(ABC):
    name: ClassVar[str]
    supported_head_sizes: ClassVar[tuple[int, ...]] = ()  # empty: any
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    supports_sliding_window: ClassVar[bool] = False
    supports_soft_cap: ClassVar[bool] = False
    supports_cuda_graphs: ClassVar[bool] = False
    # Its graph metadata stays right for uniform steps of several new tokens per request
    # (speculative decoding's verify steps, 1+K each) padded as `pad_decode` pads them: its
    # launch shapes follow the padded step, not a one-token decode's (`can_capture_verify`).
    supports_uniform_query_graphs: ClassVar[bool] = False
    supports_sinks: ClassVar[bool] = False  # its impl's supports_sinks says the same
    # Layers whose values have another head size (head_size_v); its impl's flag says the same.
    supports_diff_kv: ClassVar[bool] = False
    # Runs multi-head latent attention layers (`attention.mla`); the selector refuses MLA
    # layers on a backend without it, and an MLA backend refuses every other layer.
    supports_mla: ClassVar[bool] = False
    # The cache stores K/V lossily (quantized codes): the exact-tolerance conformance suite does
    # not apply; the backend has tests with tolerances of its own.
    lossy_kv_cache: ClassVar[bool] = False
    # Runs encoder-only layers (bidirectional, no cache kept: attention/encoder.py); its impl's
    # flag says the same.
    supports_encoder_only: ClassVar[bool] = False
    # Runs encoder-only layers with a (two-sided) sliding window (ModernBERT's local layers).
    supports_encoder_window: ClassVar[bool] = False
    # Its encoder path pads the head to a power of two, so encoder-only layers take any head
    # size, not only `supported_head_sizes` (vision towers: SigLIP's and Qwen3-VL's 72).
    encoder_takes_any_head_size: ClassVar[bool] = False
    # Honours `CommonAttentionMetadata.attend_limit` (a query sees keys up to its limit, not
    # its own position): runs layers with `bidirectional_spans` (Gemma 3's images).
    supports_bidirectional_spans: ClassVar[bool] = False
    # Reads the CSR page table's indices (`paged_kv_indices`); without it the engine does not
    # build them (a boolean gather and a copy a step).
    reads_paged_kv_indices: ClassVar[bool] = False
    description: ClassVar[str] = ""

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    # Each backend names its three classes; the get_* methods are the interface.
    impl_cls: ClassVar[type[AttentionImpl]]
    builder_cls: ClassVar[type[AttentionMetadataBuilder]]
    metadata_cls: ClassVar[type]

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return cls.builder_cls

    @classmethod
    def get_metadata_cls(cls) -> type:
        return cls.metadata_cls

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, head_size_v: int | None = None) -> tuple[int, ...]:
        """K/V outermost by default (the CPU, Triton and FlashAttention layout). With values of
        another head size (head_size_v not None, callers pass it only then) one buffer holds
        each slot's K and V rows side by side: [num_blocks, block_size, num_kv_heads,
        head_size + head_size_v], nothing padded, and the K and V views share strides."""
        if head_size_v is None:
            return (2, num_blocks, block_size, num_kv_heads, head_size)
        return (num_blocks, block_size, num_kv_heads, head_size + head_size_v)

    @staticmethod
    def kv_cache_views(kv_cache: torch.Tensor,
                       head_size_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K [num_blocks, block_size, num_kv_heads, head_size] and V [..., head_size_v] views of
        the cache (K/V outermost here; backends with another layout override this).
        head_size_v: the layer's value head size when it differs (the side-by-side layout of
        `get_kv_cache_shape`), else None."""
        if head_size_v is None:
            return kv_cache[0], kv_cache[1]
        split = kv_cache.shape[-1] - head_size_v
        return kv_cache[..., :split], kv_cache[..., split:]

    @classmethod
    def get_page_size_bytes(cls, block_size: int, num_kv_heads: int, head_size: int,
                            cache_dtype: torch.dtype, head_size_v: int | None = None) -> int:
        """Bytes one block of one layer takes in this backend's layout (memory sizing);
        head_size_v as in `get_kv_cache_shape`."""
        sizes = (head_size,) if head_size_v is None else (head_size, head_size_v)
        numel = math.prod(cls.get_kv_cache_shape(1, block_size, num_kv_heads, *sizes))
        return numel * torch.empty((), dtype=cache_dtype).element_size()

    @classmethod
    def get_kv_cache_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        """The torch dtype of the cache tensor for the user's `kv_cache_dtype` setting: "fp8"
        is e4m3 (casts to it saturate at 448) where the backend reads it, else the model's."""
        if kv_cache_dtype == "fp8" and "fp8" in cls.supported_kv_cache_dtypes:
            return torch.float8_e4m3fn
        if kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            raise ValueError(f"{cls.name}: kv_cache_dtype {kv_cache_dtype!r} not in "
                             f"{list(cls.supported_kv_cache_dtypes)}")
        return model_dtype

    @classmethod
    def for_kv_cache_dtype(cls, kv_cache_dtype: str) -> type[AttentionBackend]:
        """This backend bound to a `kv_cache_dtype` setting, for backends whose cache layout
        (shape, page bytes) depends on it (TurboQuant's presets). The engine calls it once,
        after selection, and uses the result everywhere. Default: the layout does not depend
        on it."""
        return cls

    @classmethod
    @abstractmethod
    def is_available(cls) -> tuple[bool, str]:
        """(True, what runs) or (False, why not and how to fix it)."""

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        """Reasons this backend cannot run the layer; empty when it can."""
        reasons = []
        any_head = layer.attn_type == ENCODER_ONLY and cls.encoder_takes_any_head_size
        if (cls.supported_head_sizes and layer.head_size not in cls.supported_head_sizes
                and not any_head):
            reasons.append(f"head size {layer.head_size} not in {list(cls.supported_head_sizes)}")
        if layer.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {layer.dtype} not supported")
        if layer.sliding_window is not None and not cls.supports_sliding_window:
            reasons.append("sliding window not supported")
        if layer.logits_soft_cap is not None and not cls.supports_soft_cap:
            reasons.append("logits soft-cap not supported")
        if layer.has_sinks and not cls.supports_sinks:
            reasons.append("attention sinks not supported")
        if layer.bidirectional_spans and not cls.supports_bidirectional_spans:
            reasons.append(BIDIRECTIONAL_REASON)
        reasons += cls._value_head_size_reasons(layer)
        reasons += cls._encoder_reasons(layer)
        if layer.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(f"kv_cache_dtype {layer.kv_cache_dtype!r} not in "
                           f"{list(cls.supported_kv_cache_dtypes)}")
        return reasons

    @classmethod
    def _encoder_reasons(cls, layer: AttentionLayerConfig) -> list[str]:
        """An encoder-only layer on a backend without it; the encoder paths run plain
        softmax attention, so a window, soft-cap or sinks with them are refused too."""
        if layer.attn_type != ENCODER_ONLY:
            return []
        if not cls.supports_encoder_only:
            return [ENCODER_REASON]
        window = layer.sliding_window is not None and not cls.supports_encoder_window
        extras = [name for name, on in (("a sliding window", window),
                                        ("a logits soft-cap", layer.logits_soft_cap is not None),
                                        ("attention sinks", layer.has_sinks)) if on]
        return [f"encoder-only attention with {', '.join(extras)} not supported"] if extras else []

    @classmethod
    def _value_head_size_reasons(cls, layer: AttentionLayerConfig) -> list[str]:
        if layer.head_size_v is None:
            return []
        if not cls.supports_diff_kv:
            return [diff_kv_reason(layer.head_size, layer.head_size_v)]
        if cls.supported_head_sizes and layer.head_size_v not in cls.supported_head_sizes:
            return [f"value head size {layer.head_size_v} not in "
                    f"{list(cls.supported_head_sizes)}"]
        return []

    @classmethod
    def warmup_steps(cls, device: torch.device) -> list[tuple[int, int, int]]:
        """Steps the engine runs through the whole model at start-up, as (requests, new
        tokens each, cached tokens each), for a backend that compiles per kind and size of
        step: the first requests then find their kernels compiled. Default: on CUDA,
        `CUDA_WARMUP_STEPS`; none elsewhere."""
        return list(CUDA_WARMUP_STEPS) if device.type == "cuda" else []

    @classmethod
    def is_fallback(cls) -> bool:
        """Whether what runs here is a slow reference path (a backend whose kernels are
        missing): the automatic choice then takes it only when no backend after it in the
        device's order can run the model. Default: no."""
        return False

    @classmethod
    def can_capture_cuda_graphs(cls, block_size: int) -> bool:
        """Whether decode steps at this block size may be captured in CUDA graphs (a backend
        whose implementation is chosen at run time decides per implementation)."""
        return cls.supports_cuda_graphs

    @classmethod
    def can_capture_verify(cls, block_size: int) -> bool:
        """Whether verify steps (every request the same q > 1 new tokens) may be captured in
        CUDA graphs too, beside decode steps. Default: `supports_uniform_query_graphs` where
        decode steps may be."""
        return cls.supports_uniform_query_graphs and cls.can_capture_cuda_graphs(block_size)

    @classmethod
    def features(cls) -> list[str]:
        out = ["mla"] if cls.supports_mla else []
        if cls.supports_sliding_window:
            out.append("sliding-window")
        if cls.supports_soft_cap:
            out.append("soft-cap")
        if cls.supports_sinks:
            out.append("sinks")
        if cls.supports_diff_kv:
            out.append("diff-kv")
        if cls.supports_encoder_only:
            out.append("encoder-only")
        if cls.supports_bidirectional_spans:
            out.append("bidirectional-spans")
        if cls.supported_kv_cache_dtypes != ("auto",):
            quant = [d for d in cls.supported_kv_cache_dtypes if d != "auto"]
            out.append("quantized-kv(" + ",".join(quant) + ")")
        if cls.supports_cuda_graphs:
            out.append("cuda-graphs")
        if cls.supports_uniform_query_graphs:
            out.append("verify-cuda-graphs")
        return out
