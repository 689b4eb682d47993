"""Layers the model families share: RMSNorm (with the residual add fused in), rotary
embedding, and the gated MLP's SiLU-and-mul.

Their arithmetic follows transformers' modeling code op for op (RMSNorm in float32, cos/sin cast
to the model dtype) so greedy outputs agree. On CUDA in 16 bits they run the fused Triton
kernels of `layer_kernels`, which round at the same points; that module is imported on first
use, so a CPU install never imports triton.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from transformers import PretrainedConfig

_FUSED_DTYPES = (torch.float16, torch.bfloat16)
_kernels: ModuleType | None = None
_kernels_failed = False


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The fused Triton kernels for a CUDA tensor in 16 bits, else None (the torch path: CPU
    and float32 results then match transformers op for op). Also None where triton cannot be
    imported, so a CUDA machine without it still runs."""
    global _kernels, _kernels_failed
    if not (x.is_cuda and x.dtype in _FUSED_DTYPES) or _kernels_failed:
        return None
    if _kernels is None:
        try:
            from pagedserve.models import layer_kernels
        except ImportError:
            _kernels_failed = True
            return None
        _kernels = layer_kernels
    return _kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I], fused on CUDA in 16 bits."""
    kernels = fused_kernels(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class RMSNorm(nn.Module):
    # Set where the next projection reads FP8 (`LlamaDecoderLayer.fuse_fp8_inputs`): the norm
    # then emits its output quantized in groups of this many (the width: one per token).
    fp8_group: int | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x) or, given the residual stream, (RMSNorm(x + residual), x + residual)."""
        if self.fp8_group is not None and x.dim() == 2:
            from pagedserve.quantization.ops.fp8_fused import rms_norm_fp8

            group = None if self.fp8_group == x.shape[-1] else self.fp8_group
            out = rms_norm_fp8(x, residual, self.weight, self.eps, group)
            return out if residual is None else (out, residual)
        kernels = fused_kernels(x)
        if kernels is not None and x.dim() == 2:
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps)
            return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalise in float32, cast back, then scale in the model dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Float32ScaledRMSNorm(RMSNorm):
    """RMSNorm scaled by (offset + weight) in float32 before the cast back, as OLMo-2 (offset
    0) and Gemma (offset 1: its checkpoints store weight - 1) round; the torch path only."""

    offset = 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.offset + self.weight.float())).to(x.dtype)


class GemmaRMSNorm(Float32ScaledRMSNorm):
    offset = 1.0


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The rope settings in one shape for transformers 4.x (`rope_theta` + `rope_scaling`) and
    5.x (`rope_parameters`, keyed by layer type where the layer types differ: Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    elif layer_type is not None:
        params = params[layer_type]
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: PretrainedConfig, head_dim: int, layer_type: str | None = None,
                  seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq [rotary dim // 2] float32 and the cos/sin scale, from transformers' own rope init
    functions (`default` is not among them in transformers 5, so it is computed here as
    transformers' Llama does). `seq_len` reaches the functions that depend on it (LongRoPE's
    long factors apply past the original context).

    `dynamic` NTK in transformers recomputes inv_freq only once a sequence grows past
    max_position_embeddings; at or below it the frequencies are the init-time ones. The engine
    caps max_model_len at max_position_embeddings, so the init-time frequencies are exact for
    every length it serves."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type in ROPE_INIT_FUNCTIONS:
        extra = {} if layer_type is None else {"layer_type": layer_type}
        if seq_len is not None:
            extra["seq_len"] = seq_len
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
        return inv_freq.float(), float(scaling)
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported; transformers knows "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)}")
    base = params["rope_theta"]
    dim = rotary_dim(config, head_dim, layer_type)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


def rotary_dim(config: PretrainedConfig, head_dim: int, layer_type: str | None = None) -> int:
    """How many leading dims of each head the rotary embedding turns (`partial_rotary_factor`,
    e.g. Bamba's half); the rest pass through."""
    factor = rope_parameters(config, layer_type).get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def _rope_table(config: PretrainedConfig, head_dim: int, layer_type: str | None,
                max_positions: int, max_model_len: int) -> torch.Tensor:
    """[P, rotary dim] float32: cos | sin of every position. LongRoPE (Phi-3) picks one factor
    set for the engine, as llama.cpp does: the long factors when the engine serves sequences past
    `original_max_position_embeddings` (`max_model_len`), else the short ones. Mixing them by
    position would break relative positions between old keys and new queries; switching per
    sequence, as transformers does (it recomputes the whole sequence once it grows past the
    original context), would invalidate cached K. Both agree with transformers on every
    sequence when max_model_len is within the original context."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq, scaling = rope_inv_freq(config, head_dim, layer_type)
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "longrope":
        original = (params.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", max_positions))
        if max_model_len > original:
            inv_freq, _ = rope_inv_freq(config, head_dim, layer_type, seq_len=original + 1)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to max_position_embeddings, computed once ([P, D/2] each,
    in the model dtype as transformers casts them), gathered by position each step."""

    def __init__(self, config: PretrainedConfig, head_dim: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        self.layer_type = layer_type  # rope settings per layer type (Gemma 3), else None
        self.max_positions = config.max_position_embeddings
        self.max_model_len = self.max_positions  # what the engine serves (LongRoPE's choice)
        self.rotary_dim = rotary_dim(config, head_dim, layer_type)
        self.register_buffer("cos_sin_cache", torch.empty(self.max_positions, self.rotary_dim),
                             persistent=False)
        self._positions: torch.Tensor | None = None  # the step whose cos/sin are gathered
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.cos_sin_cache.device.type != "meta":
            self.build_cache(self.cos_sin_cache.device, torch.get_default_dtype())

    def build_cache(self, device: torch.device, dtype: torch.dtype,
                    max_model_len: int | None = None) -> None:
        if max_model_len is not None:
            self.max_model_len = max_model_len
        cache = _rope_table(self.config, self.head_dim, self.layer_type, self.max_positions,
                            self.max_model_len)
        self.cos_sin_cache = cache.to(device=device, dtype=dtype)
        self._positions = self._cos_sin = None

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, Hkv, D] -> rotated (rotate-half convention); on the fused
        path in place."""
        partial = self.rotary_dim < self.head_dim
        kernels = fused_kernels(query)
        if kernels is not None and not partial:
            kernels.rotary_embedding_(positions, query, key, self.cos_sin_cache)
            return query, key
        # Every layer of a step rotates by the same positions: gather cos/sin once per step,
        # keyed by the tensor (the common metadata hands out a new positions view each step).
        if positions is not self._positions:
            self._positions = positions
            self._cos_sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        cos, sin = self._cos_sin
        if partial:  # the leading rotary_dim dims turn, the rest pass through
            d = self.rotary_dim
            return (torch.cat([_rotate(query[..., :d], cos, sin), query[..., d:]], dim=-1),
                    torch.cat([_rotate(key[..., :d], cos, sin), key[..., d:]], dim=-1))
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def build_rope_caches(module: nn.Module, device: torch.device, dtype: torch.dtype,
                      max_model_len: int | None = None) -> None:
    """(Re)build every rotary embedding's cos/sin table under `module` (after loading, or
    after `to_empty` left the non-persistent tables unset); `max_model_len`: the longest
    sequence the engine serves, where the table depends on it (LongRoPE)."""
    for sub in module.modules():
        if isinstance(sub, RotaryEmbedding):
            sub.build_cache(device, dtype, max_model_len)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
