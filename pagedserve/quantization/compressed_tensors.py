"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's output,
e.g. the FP8_DYNAMIC releases): FP8 weights per tensor, per channel or per block, their scale
named `weight_scale`; activations dynamic per token, static per tensor (`input_scale`), or none.
Every other format, scheme or target is refused at start-up by name."""

from __future__ import annotations

import logging
from typing import Any

from pagedserve.quantization.fp8 import Fp8Config
from pagedserve.quantization.fp8_format import Fp8Scheme

FORMATS = ("float-quantized", "naive-quantized")
logger = logging.getLogger(__name__)

SUPPORTED = ("weights: 8-bit float, strategy tensor / channel / block, static; activations: none, "
             "8-bit float dynamic per token, or static per tensor; targets: Linear")


class CompressedTensorsConfig(Fp8Config):
    name = "compressed-tensors"

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> CompressedTensorsConfig:
        fmt = data.get("format")
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: "
                             f"{', '.join(FORMATS)})")
        if data.get("kv_cache_scheme"):
            logger.info("compressed-tensors kv_cache_scheme: its K/V scales apply with "
                        "--kv-cache-dtype fp8; the KV cache is as that flag says")
        groups = list((data.get("config_groups") or {}).values())
        if not groups:
            raise ValueError("compressed-tensors config has no config_groups")
        schemes = {_scheme(group) for group in groups}
        if len(schemes) > 1:
            raise ValueError("compressed-tensors config groups with different schemes are not "
                             f"supported: {sorted(s.describe() for s in schemes)}")
        return cls(schemes.pop(), list(data.get("ignore") or []))


def _scheme(group: dict[str, Any]) -> Fp8Scheme:
    targets = group.get("targets") or []
    if list(targets) != ["Linear"]:
        raise ValueError(f"compressed-tensors targets {targets} are not supported "
                         f"(supported: {SUPPORTED})")
    weights = group.get("weights") or {}
    strategy = weights.get("strategy")
    if (weights.get("num_bits"), weights.get("type")) != (8, "float") or weights.get("dynamic") \
            or strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"compressed-tensors weights {_brief(weights)} are not supported "
                         f"(supported: {SUPPORTED})")
    block = None
    if strategy == "block":
        structure = weights.get("block_structure") or []
        if len(structure) != 2:
            raise ValueError(f"compressed-tensors block weights need a block_structure of two "
                             f"sizes, got {structure}")
        block = (int(structure[0]), int(structure[1]))
    return Fp8Scheme(strategy, _activation(group.get("input_activations")), block)


def _activation(acts: dict[str, Any] | None) -> str:
    if not acts:
        return "none"
    kind = (acts.get("num_bits"), acts.get("type"), acts.get("strategy"),
            bool(acts.get("dynamic")))
    if kind == (8, "float", "token", True):
        return "dynamic"
    if kind == (8, "float", "tensor", False):
        return "static"
    raise ValueError(f"compressed-tensors input_activations {_brief(acts)} are not supported "
                     f"(supported: {SUPPORTED})")


def _brief(args: dict[str, Any]) -> str:
    keys = ("num_bits", "type", "strategy", "dynamic")
    return "{" + ", ".join(f"{k}={args.get(k)!r}" for k in keys) + "}"
