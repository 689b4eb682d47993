"""The tests' own 4-bit (and GPTQ / compressed-tensors 8-bit) quantizers and packers: a float
checkpoint's projections rewritten as AWQ, GPTQ, compressed-tensors pack-quantized or
int-quantized (unpacked int8) or (gpt-oss experts) MXFP4 tensors, beside a float
checkpoint of the very values those codes stand for (the reference transformers runs).

Written apart from `pagedserve.quantization` on purpose, from the formats' descriptions: a
shared mistake would pass. The MXFP4 packer is checked against transformers' own dequantizer
(test_int4_checkpoints)."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
AWQ_NIBBLE_COLUMNS = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i holds column AWQ_NIBBLE_COLUMNS[i]


def quantize(w: torch.Tensor, group_size: int, sym: bool, act_order: bool = False,
             min_zero: int = 0, scale_dtype: torch.dtype = torch.float16,
             seed: int = 0, bits: int = 4) -> dict[str, torch.Tensor]:
    """w [N, K] -> unsigned codes q [N, K] (0..2^bits - 1), zeros [N, G] (0..2^bits - 1;
    2^(bits - 1) when symmetric), scales [N, G] in `scale_dtype`, g_idx [K], and deq [N, K] =
    (q - zero) * scale in float32. act_order: the groups are runs of a random permutation of
    the inputs."""
    top, mid = (1 << bits) - 1, 1 << (bits - 1)
    w = w.float()
    n, k = w.shape
    size = k if group_size == -1 else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order \
        else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // size).to(torch.int32)
    groups = k // size
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scales[:, g] = cols.abs().amax(1) / (mid - 1)
            zeros[:, g] = mid
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = (hi - lo) / top
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(min_zero, top)
    scales = scales.to(scale_dtype)
    s = scales.float()[:, g_idx.long()]
    z = zeros[:, g_idx.long()]
    q = torch.round(w / s + z).clamp(0, top)
    return {"q": q.to(torch.int32), "zeros": zeros.to(torch.int32), "scales": scales,
            "g_idx": g_idx, "deq": (q - z) * s}


def pack(codes: torch.Tensor, dim: int, nibble_columns: list[int] | None = None,
         bits: int = 4) -> torch.Tensor:
    """Integers 0..2^bits - 1 -> int32 words of p = 32 / bits along `dim` (padded with
    zeros); field i (bits i*bits and up) of word c holds element p*c + nibble_columns[i]
    (default i)."""
    a = codes.numpy().astype(np.uint32)
    if dim == 0:
        return pack(codes.t(), 1, nibble_columns, bits).t().contiguous()
    per = 32 // bits
    pad = -a.shape[1] % per
    a = np.pad(a, [(0, 0), (0, pad)])
    order = nibble_columns or list(range(per))
    out = np.zeros((a.shape[0], a.shape[1] // per), dtype=np.uint32)
    for i in range(per):
        out |= a[:, order[i]::per] << np.uint32(bits * i)
    return torch.from_numpy(out.view(np.int32).copy())


def awq_tensors(w: torch.Tensor, group_size: int) -> tuple[dict, torch.Tensor]:
    r = quantize(w, group_size, sym=False)
    return {"qweight": pack(r["q"].t(), 1, AWQ_NIBBLE_COLUMNS),
            "qzeros": pack(r["zeros"].t(), 1, AWQ_NIBBLE_COLUMNS),
            "scales": r["scales"].t().contiguous()}, r["deq"]


def gptq_tensors(w: torch.Tensor, group_size: int, sym: bool, act_order: bool, v1: bool,
                 seed: int, bits: int = 4) -> tuple[dict, torch.Tensor]:
    # gptq (v1) stores zero - 1 in `bits` bits, which cannot hold a zero of 0.
    r = quantize(w, group_size, sym, act_order, min_zero=1 if v1 else 0, seed=seed, bits=bits)
    return {"qweight": pack(r["q"].t(), 0, bits=bits),
            "qzeros": pack((r["zeros"] - int(v1)).t(), 1, bits=bits),
            "scales": r["scales"].t().contiguous(),
            "g_idx": r["g_idx"]}, r["deq"]


def ct_tensors(w: torch.Tensor, group_size: int, sym: bool, act_order: bool, seed: int,
               bits: int = 4) -> tuple[dict, torch.Tensor]:
    # compressed-tensors stores signed values plus 2^(bits - 1): the unsigned codes as they
    # are, their zero points likewise.
    r = quantize(w, group_size, sym, act_order, scale_dtype=torch.bfloat16, seed=seed,
                 bits=bits)
    out = {"weight_packed": pack(r["q"], 1, bits=bits), "weight_scale": r["scales"],
           "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = pack(r["zeros"], 0, bits=bits)
    if act_order:
        out["weight_g_idx"] = r["g_idx"]
    return out, r["deq"]


def ct_int8_tensors(w: torch.Tensor, group_size: int | None, sym: bool, act_order: bool,
                    seed: int) -> tuple[dict, torch.Tensor]:
    """compressed-tensors int-quantized: the signed int8 codes unpacked as `weight` [N, K],
    `weight_scale` [N, G] ([1] per tensor), signed int8 `weight_zero_point` shaped as the scale
    when asymmetric. group_size None: one scale for the whole tensor."""
    if group_size is None:
        r = _quantize_per_tensor(w, sym)
    else:
        r = quantize(w, group_size, sym, act_order, scale_dtype=torch.bfloat16, seed=seed,
                     bits=8)
    out = {"weight": (r["q"] - 128).to(torch.int8), "weight_scale": r["scales"]}
    if not sym:
        out["weight_zero_point"] = (r["zeros"] - 128).to(torch.int8)
    if act_order:
        out["weight_g_idx"] = r["g_idx"]
    return out, r["deq"]


def _quantize_per_tensor(w: torch.Tensor, sym: bool) -> dict[str, torch.Tensor]:
    w = w.float()
    if sym:
        scale, zero = w.abs().max() / 127, torch.tensor(128.0)
    else:
        lo, hi = w.min().clamp(max=0), w.max().clamp(min=0)
        scale = (hi - lo) / 255
        zero = torch.round(-lo / scale).clamp(0, 255)
    scale = scale.to(torch.bfloat16).reshape(1)
    q = torch.round(w / scale.float() + zero).clamp(0, 255)
    return {"q": q.to(torch.int32), "zeros": zero.reshape(1).to(torch.int32), "scales": scale,
            "deq": (q - zero) * scale.float()}


def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def gptq_config(group_size: int, sym: bool, act_order: bool, v1: bool, bits: int = 4
                ) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
            "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": False,
            "true_sequential": True, "damp_percent": 0.01}


def ct_config(group_size: int, sym: bool, act_order: bool, bits: int = 4) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size,
               "actorder": "group" if act_order else None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$"], "quantization_status": "compressed"}


def ct_int8_config(group_size: int | None, sym: bool, act_order: bool = False,
                   fmt: str = "int-quantized") -> dict:
    """group_size: -1 per channel, None per tensor."""
    config = ct_config(-1 if group_size is None else group_size, sym, act_order, bits=8)
    weights = config["config_groups"]["group_0"]["weights"]
    if group_size is None:
        weights["strategy"] = "tensor"
    config["format"] = fmt
    return config


def write_int4(src: Path, dst: Path, ref: Path, qconfig: dict) -> None:
    """src: a float checkpoint (save_pretrained). dst: its projections packed as `qconfig`
    says; ref: the same model with the dequantized values, in float32, for transformers."""
    method = qconfig["quant_method"]
    if method == "awq":
        def tensors(w, seed):
            return awq_tensors(w, qconfig["group_size"])
    elif method == "gptq":
        def tensors(w, seed):
            return gptq_tensors(w, qconfig["group_size"], qconfig["sym"], qconfig["desc_act"],
                                qconfig["checkpoint_format"] == "gptq", seed, qconfig["bits"])
    elif qconfig["format"] != "pack-quantized":  # int-quantized, naive-quantized
        weights = qconfig["config_groups"]["group_0"]["weights"]
        group = {"tensor": None, "channel": -1}.get(weights["strategy"], weights["group_size"])

        def tensors(w, seed):
            return ct_int8_tensors(w, group, weights["symmetric"],
                                   weights["actorder"] == "group", seed)
    else:
        weights = qconfig["config_groups"]["group_0"]["weights"]
        group = weights["group_size"] or -1

        def tensors(w, seed):
            return ct_tensors(w, group, weights["symmetric"], weights["actorder"] == "group",
                              seed, weights["num_bits"])
    state = _state(src)
    quantized, dequantized = {}, {}
    for name, t in sorted(state.items()):
        if not PROJECTIONS.search(name):
            quantized[name] = dequantized[name] = t
            continue
        module = name.rpartition(".")[0]
        packed, dequantized[name] = tensors(t, _input_seed(name))
        quantized.update({f"{module}.{leaf}": v for leaf, v in packed.items()})
    _save(src, dst, quantized, qconfig)
    _save(src, ref, dequantized, None)


def _input_seed(name: str) -> int:
    """One act-order permutation per input: projections that read the same input (q, k, v;
    gate, up) share it, as GPTQ's order (by the input's Hessian) does."""
    shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
    return zlib.crc32(shared.replace("up_proj", "gate_proj").encode())


# ---- MXFP4 (gpt-oss experts) -----------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [..., K] -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32], deq): each 32
    inputs share 2^e, the smallest power that brings their maximum within e2m1's 6; codes the
    nearest e2m1 value, sign in bit 3; two codes a byte, the lower index in the low nibble."""
    x = rows.float().reshape(*rows.shape[:-1], -1, 32)
    amax = x.abs().amax(-1).clamp(min=2.0 ** -100)
    e = torch.ceil(torch.log2(amax / 6.0))
    y = x / torch.exp2(e)[..., None]
    mag = (y.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = mag + 8 * (y < 0).long() * (mag > 0).long()
    deq = torch.cat([E2M1, -E2M1])[codes] * torch.exp2(e)[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8), deq.flatten(-2)


def mxfp4_config() -> dict:
    return {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}


def write_mxfp4(src: Path, dst: Path, ref: Path) -> None:
    """gpt-oss: the experts' gate_up_proj [E, H, 2I] and down_proj [E, I, H] as OpenAI stores
    them, blocks and scales of the transposed rows ([E, 2I, H/32, 16], [E, H, I/32, 16])."""
    state = _state(src)
    quantized, dequantized = {}, {}
    for name, t in state.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            quantized[name] = dequantized[name] = t
            continue
        blocks, scales, deq = mxfp4(t.transpose(1, 2))
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dequantized[name] = deq.transpose(1, 2)
    _save(src, dst, quantized, mxfp4_config())
    _save(src, ref, dequantized, None)


def _state(src: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def _save(src: Path, path: Path, tensors: dict, qconfig: dict | None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if qconfig:
        config["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(config))
