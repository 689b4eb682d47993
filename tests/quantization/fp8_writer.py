"""The tests' own FP8 quantizer and checkpoint writer (transformers cannot create FP8 weights
without a GPU): a float checkpoint's projections rewritten as FP8 codes with scales, in the
native `fp8` layout or compressed-tensors', beside a float checkpoint of the very values those
codes stand for (the reference transformers runs).

Written apart from `pagedserve.quantization` on purpose: a shared mistake would pass."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PROJECTIONS = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|"
                         r"q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$")


def quantize(w: torch.Tensor, kind: str, block: tuple[int, int] | None = None,
             scale_dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, stored scale, dequantized float32) of w [N, K]; `kind` tensor, channel or
    block (edge blocks as if zero-padded)."""
    w = w.float()
    n, k = w.shape
    if kind == "block":
        bn, bk = block
        rn, rk = math.ceil(n / bn), math.ceil(k / bk)
        padded = torch.zeros(rn * bn, rk * bk)
        padded[:n, :k] = w
        tiles = padded.reshape(rn, bn, rk, bk).permute(0, 2, 1, 3)
        scale = (tiles.abs().amax(dim=(-1, -2)) / E4M3_MAX).to(scale_dtype).float()
        codes = (tiles / scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        deq = codes.float() * scale[..., None, None]

        def untile(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1, 3).reshape(rn * bn, rk * bk)[:n, :k].contiguous()

        return untile(codes), scale.to(scale_dtype), untile(deq)
    if kind == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(scale_dtype).float()
    else:
        scale = (w.abs().amax() / E4M3_MAX).reshape(1).to(scale_dtype).float()
    codes = (w / scale.reshape(-1, 1) if kind == "channel" else w / scale).clamp(
        -E4M3_MAX, E4M3_MAX).to(E4M3)
    deq = codes.float() * (scale if kind == "channel" else scale)
    return codes, scale.to(scale_dtype), deq


def native_config(block: tuple[int, int] | None, activation: str = "dynamic",
                  ignored: list[str] | None = None) -> dict:
    config = {"quant_method": "fp8", "activation_scheme": activation, "fmt": "e4m3"}
    if block:
        config["weight_block_size"] = list(block)
    if ignored is not None:
        config["ignored_layers"] = ignored
    return config


def compressed_config(kind: str, activation: str, block: tuple[int, int] | None = None,
                      ignore: list[str] | None = None) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": kind, "symmetric": True,
               "dynamic": False}
    if block:
        weights["block_structure"] = list(block)
    acts = {"dynamic": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                        "symmetric": True},
            "static": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                       "symmetric": True}}.get(activation)
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}},
            "ignore": ignore if ignore is not None else ["lm_head"],
            "quantization_status": "compressed"}


def write_fp8(src: Path, dst: Path, qconfig: dict, ref: Path,
              scale_dtype: torch.dtype = torch.float32) -> None:
    """src: a float checkpoint (save_pretrained). dst: it in FP8 as `qconfig` says; ref: the
    same model with the dequantized values, in float32, for transformers."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    native = qconfig["quant_method"] == "fp8"
    if native:
        block = qconfig.get("weight_block_size")
        kind = "block" if block else "tensor"
        static = qconfig["activation_scheme"] == "static"
        scale_name = "weight_scale_inv" if block else "weight_scale"
        ignored = qconfig.get("ignored_layers", [])
    else:
        group = qconfig["config_groups"]["group_0"]
        kind, block = group["weights"]["strategy"], group["weights"].get("block_structure")
        static = (group["input_activations"] or {}).get("dynamic") is False
        scale_name = "weight_scale"
        ignored = qconfig["ignore"]
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        module = name.rpartition(".")[0]
        if not PROJECTIONS.search(name) or module in ignored:
            quantized[name] = dequantized[name] = tensor
            continue
        codes, scale, deq = quantize(tensor, kind, tuple(block) if block else None, scale_dtype)
        quantized[name] = codes
        quantized[f"{module}.{scale_name}"] = scale
        if static:
            quantized[f"{module}.input_scale"] = torch.tensor([0.1])  # inputs up to 44.8
        dequantized[name] = deq
    for path, tensors, extra in ((dst, quantized, {"quantization_config": qconfig}),
                                 (ref, dequantized, {})):
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
        config = json.loads((src / "config.json").read_text())
        config.pop("quantization_config", None)
        (path / "config.json").write_text(json.dumps({**config, **extra}))
