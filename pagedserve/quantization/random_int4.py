"""Random weights as a GPTQ checkpoint holds them (`random:<config file>` whose fields carry a
GPTQ `quantization_config`), for timing the 4-bit path at a real model's shape without one:
each projection is drawn as the float model draws it (same generator, order and dtype, so the
bf16 `random:` model of the same shape has the very values these codes round) and packed as
it is made, so the model loads through the GPTQ method as a downloaded checkpoint would.

    {"base": "llama3-8b", "quantization_config": {"quant_method": "gptq", "bits": 4,
     "group_size": 128, "sym": true, "desc_act": false}}

Symmetric codes only (zero 2^(bits-1)), groups in input order; checkpoint_format gptq (the
zero stored minus one) unless the config says gptq_v2.
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
    n, k = w.shape
    size = k if group == -1 else group
    zeros = torch.full(scales.shape, (1 << (bits - 1)) - int(v1), dtype=torch.int32,
                       device=w.device)
    return {"qweight": pack_words(codes.t().contiguous(), bits),
            "qzeros": pack_words(zeros, bits).t().contiguous(),  # [G, N / p]: along outputs
            "scales": scales.t().contiguous(),
            "g_idx": torch.arange(k, device=w.device, dtype=torch.int32) // size}


def random_gptq_weights(weights: Iterator[tuple[str, torch.Tensor]], data: dict[str, Any]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The float model's weights (`random_full_weights`), each projection as GPTQ tensors."""
    bits, group, v1 = check_random_gptq(data)
    for name, tensor in weights:
        if PROJECTION.search(name) is None:
            yield name, tensor
            continue
        prefix = name[:-len("weight")]
        for key, value in gptq_tensors(tensor, bits, group, v1).items():
            yield prefix + key, value
