"""GPTQ checkpoints (`quant_method: gptq`, AutoGPTQ / GPTQModel), 4 or 8 bits: per linear
`qweight` int32 [in / p, out] with p = 32 / bits codes a word packed along the input dim, low
bits first (code i: input p*r+i), `qzeros` int32 [groups, out / p] packed likewise along the
output dim, `scales` float16 [groups, out],
and `g_idx` int32 [in], each input's group. With `desc_act` (act-order) the inputs were
quantized in another order, so `g_idx` is any map and must be there; without it the groups
are runs of `group_size` inputs (a `g_idx` present is still read). `checkpoint_format` gptq
stores each zero point minus one (read back as code + 1, as the kernels do), gptq_v2 as is;
`sym` changes the values only (zero 2^(bits - 1)), not the layout. Other widths (2, 3) are
refused by name. Dequantized at load (packed.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.quantization import int_codes as fmt
from pagedserve.quantization.base import QuantizationConfig
from pagedserve.quantization.packed import PackedFormat, check_family, packed_method

FORMATS = ("gptq", "gptq_v2")


class GptqFormat(PackedFormat):
    def __init__(self, group_size: int, act_order: bool, zero_offset: int, bits: int = 4
                 ) -> None:
        self.group_size = group_size
        self.act_order = act_order
        self.zero_offset = zero_offset  # 1: v1's zero points are stored minus one
        self.bits = bits
        version = "gptq" if zero_offset else "gptq_v2"
        self.name = (f"GPTQ int{bits} ({version}), group {group_size}"
                     + (", act-order" if act_order else ""))

    def checkpoint_tensors(self) -> tuple[str, ...]:
        base = ("qweight", "qzeros", "scales")
        # One group (group_size -1) makes act-order's map meaningless, so it may be absent.
        return (*base, "g_idx") if self.act_order and self.group_size != -1 else base

    def optional_tensors(self) -> tuple[str, ...]:
        return ("g_idx",)

    def unpack(self, tensors: dict[str, torch.Tensor], what: str) -> fmt.IntCodes:
        qweight = tensors["qweight"]
        per_word = 32 // self.bits
        k, n = qweight.shape[0] * per_word, qweight.shape[1]
        size, groups = fmt.groups_of(k, self.group_size, what)
        why = f"a [{k}, {n}] weight in groups of {size}"
        if self.act_order and self.group_size != -1:
            # Act-order groups need not be runs, but there are still k / size of them.
            why += " (act-order)"
        fmt.check_shape(tensors["qzeros"], (groups, n // per_word), f"{what}.qzeros", why)
        fmt.check_shape(tensors["scales"], (groups, n), f"{what}.scales", why)
        codes = fmt.unpack_int32(qweight, 0, f"{what}.qweight", self.bits)  # [K, N]
        zeros = fmt.unpack_int32(tensors["qzeros"], 1, f"{what}.qzeros", self.bits) \
            + self.zero_offset
        group = fmt.group_index(tensors.get("g_idx"), k, size, groups, f"{what}.g_idx")
        return fmt.IntCodes(codes.t(), zeros.t(), tensors["scales"].t(), group, self.bits)


class GptqConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, packed: GptqFormat) -> None:
        super().__init__()
        self.format = packed

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> GptqConfig:
        bits = data.get("bits")
        version = data.get("checkpoint_format", data.get("format", "gptq"))
        if bits not in fmt.WIDTHS or version not in FORMATS:
            raise ValueError(f"GPTQ bits={bits}, checkpoint_format={version!r} is not "
                             f"supported (supported: 4 or 8 bits, {' or '.join(FORMATS)})")
        if data.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head (lm_head: true) is not supported")
        if data.get("dynamic"):
            raise ValueError("GPTQ per-module overrides (dynamic) are not supported")
        group = int(data.get("group_size", 128))
        return cls(GptqFormat(group, bool(data.get("desc_act")), int(version == "gptq"), bits))

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]) -> Any:
        if prefix == "lm_head":
            return None
        return packed_method(self.format, layer, prefix, hf_names)

    def check_model(self, model: nn.Module) -> None:
        check_family(model, "GPTQ")
