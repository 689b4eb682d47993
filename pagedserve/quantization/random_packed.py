"""Random weights as a quantized checkpoint holds them (`random:<config file>` whose fields
carry a GPTQ or MXFP4 `quantization_config`), for timing the 4-bit paths at a real model's shape
without one: each tensor is drawn as the float model draws it (same generator, order and dtype,
so the bf16 `random:` model of the same shape has the very values these codes round) and
packed as it is made, so the model loads through the format's method as a downloaded
checkpoint would: its packed tensors handed over on the host, where a checkpoint's are read
(the formats unpack them there; drawn on a GPU, they are packed there first).

    {"base": "llama3-8b", "quantization_config": {"quant_method": "gptq", "bits": 4,
     "group_size": 128, "sym": true, "desc_act": false}}
    {"base": "gpt-oss-20b", "quantization_config": {"quant_method": "mxfp4"}}

GPTQ: every decoder projection, symmetric codes only (zero 2^(bits-1)), groups in input
order; checkpoint_format gptq (the zero stored minus one) unless the config says gptq_v2.
MXFP4: gpt-oss's experts, as OpenAI publishes them (blocks and scales of the rows before
transformers' transpose, gate and up rows interleaved); attention, router, embeddings and head
stay float.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

# The decoder projections a GPTQ checkpoint quantizes (experts' included); never the
# embeddings, the head, norms or routers.
PROJECTION = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def check_random_gptq(data: dict[str, Any]) -> tuple[int, int, bool]:
    """(bits, group size, v1) of a random model's GPTQ config; what it cannot make is refused
    by name."""
    bits, group = int(data.get("bits", 4)), int(data.get("group_size", 128))
    if bits not in (4, 8):
        raise ValueError(f"random GPTQ weights: bits {bits} (4 or 8 are made)")
    if not data.get("sym", True) or data.get("desc_act", False):
        raise ValueError("random GPTQ weights are symmetric and in input order: set sym true "
                         "and desc_act false")
    return bits, group, data.get("checkpoint_format", "gptq") != "gptq_v2"


def quantize_symmetric(w: torch.Tensor, bits: int, group: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(unsigned codes [N, K] int32, float16 scales [N, G]) of w [N, K]: per output row and
    input group, scale = amax / (2^(bits-1) - 1) (in float16) and code = round(w / scale) +
    2^(bits-1)."""
    n, k = w.shape
    size = k if group == -1 else group
    if k % size:
        raise ValueError(f"random GPTQ weights: {k} inputs are not a multiple of group_size "
                         f"{size}")
    mid = 1 << (bits - 1)
    grouped = w.float().view(n, k // size, size)
    scales = (grouped.abs().amax(-1) / (mid - 1)).to(torch.float16)
    codes = torch.round(grouped / scales.float()[..., None] + mid).clamp(0, 2 * mid - 1)
    return codes.view(n, k).to(torch.int32), scales


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, C] (0..2^bits - 1) -> int32 words [R / p, C], p = 32 / bits along the rows:
    field i (bits i*bits and up) of word r holds row p*r + i."""
    per = 32 // bits
    rows, cols = codes.shape
    shifts = (torch.arange(per, device=codes.device, dtype=torch.int64) * bits)[None, :, None]
    words = (codes.to(torch.int64).view(rows // per, per, cols) << shifts).sum(1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of 32 bits


def gptq_tensors(w: torch.Tensor, bits: int, group: int, v1: bool) -> dict[str, torch.Tensor]:
    """A GPTQ checkpoint's tensors for the float weight w [N, K]."""
    codes, scales = quantize_symmetric(w, bits, group)
    k = w.shape[1]
    zeros = torch.full(scales.shape, (1 << (bits - 1)) - int(v1), dtype=torch.int32,
                       device=w.device)
    return {"qweight": pack_words(codes.t().contiguous(), bits),
            "qzeros": pack_words(zeros, bits).t().contiguous(),  # [G, N / p]: along outputs
            "scales": scales.t().contiguous(),
            "g_idx": torch.arange(k, device=w.device, dtype=torch.int32) // (k // scales.shape[1])}


def mxfp4_tensors(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]) of rows [..., K]: each 32
    inputs share 2^e, the smallest power that brings their largest magnitude within e2m1's 6
    (scale byte e + 127); each value the nearest e2m1 code, sign in bit 3; two codes a byte,
    the lower input in the low nibble."""
    from pagedserve.quantization.mxfp4 import BLOCK, E2M1, E8M0_BIAS

    magnitudes = E2M1[:8]  # codes 0..7; 8..15 are their negatives
    x = rows.float().contiguous().reshape(*rows.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(-1).clamp(min=2.0 ** -100)
    e = torch.ceil(torch.log2(amax / float(magnitudes[-1])))
    y = x / torch.exp2(e)[..., None]
    # The nearest magnitude: the bucket between consecutive ones' midpoints (a tie: the smaller).
    mids = ((magnitudes[1:] + magnitudes[:-1]) / 2).to(x.device)
    mag = torch.bucketize(y.abs(), mids)
    codes = (mag + 8 * ((y < 0) & (mag > 0))).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e + E8M0_BIAS).to(torch.uint8)


def _mxfp4_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' stacked experts (gate_up_proj [E, H, 2I], down_proj [E, I, H]) as OpenAI's
    `_blocks` / `_scales` of their rows ([E, 2I, H / 32, 16] ...), an expert at a time (a
    120B layer's experts would not fit their codes' float intermediates at once)."""
    parts = [mxfp4_tensors(tensor[e].t()) for e in range(tensor.shape[0])]
    yield name + "_blocks", torch.stack([b for b, _ in parts]).cpu()
    yield name + "_scales", torch.stack([s for _, s in parts]).cpu()


def random_packed_weights(weights: Iterator[tuple[str, torch.Tensor]], data: dict[str, Any]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The float model's weights (`random_full_weights`, under transformers' names) as the
    checkpoint of `data`'s format holds them; what cannot be made is refused here, before any
    weight is drawn."""
    method = data.get("quant_method")
    if method == "mxfp4":
        return _mxfp4_stream(weights)
    if method == "gptq":
        return _gptq_stream(weights, *check_random_gptq(data))
    raise ValueError(f"random weights: quantization_config quant_method {method!r} is not "
                     "made for random weights (gptq and mxfp4 are)")


def _mxfp4_stream(weights: Iterator[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            yield from _mxfp4_experts(name, tensor)
        else:
            yield name, tensor


def _gptq_stream(weights: Iterator[tuple[str, torch.Tensor]], bits: int, group: int, v1: bool
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if PROJECTION.search(name) is None:
            yield name, tensor
            continue
        prefix = name[:-len("weight")]
        for key, value in gptq_tensors(tensor, bits, group, v1).items():
            yield prefix + key, value.cpu()
