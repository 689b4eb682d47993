"""AWQ checkpoints (`quant_method: awq`, AutoAWQ's GEMM layout): per linear `qweight` int32
[in, out / 8] with eight 4-bit codes a word packed along the output dim, `qzeros` int32
[groups, out / 8] packed the same way, `scales` float16 [groups, out]; each word holds output
columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7, so column j of a word is nibble
0, 4, 1, 5, 2, 6, 3, 7 [j]. Asymmetric: w = (q - zero) * scale per group of `group_size`
inputs. Dequantized at load (packed.py); other versions (gemv, marlin) are refused."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.quantization import int_codes as fmt
from pagedserve.quantization.base import QuantizationConfig
from pagedserve.quantization.packed import PackedFormat, check_family, packed_method

# Nibble i of a word holds output column ORDER[i] of its eight.
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Column j of a word is nibble UNORDER[j].
UNORDER = (0, 4, 1, 5, 2, 6, 3, 7)


class AwqFormat(PackedFormat):
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.name = f"AWQ int4, group {group_size}"

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def unpack(self, tensors: dict[str, torch.Tensor], what: str) -> fmt.IntCodes:
        qweight = tensors["qweight"]
        k, n = qweight.shape[0], qweight.shape[1] * fmt.PER_WORD
        size, groups = fmt.groups_of(k, self.group_size, what)
        codes = _columns(qweight, f"{what}.qweight")  # [K, N]
        fmt.check_shape(tensors["qzeros"], (groups, n // fmt.PER_WORD), f"{what}.qzeros",
                        f"a [{k}, {n}] weight in groups of {size}")
        fmt.check_shape(tensors["scales"], (groups, n), f"{what}.scales",
                        f"a [{k}, {n}] weight in groups of {size}")
        zeros = _columns(tensors["qzeros"], f"{what}.qzeros")
        group = torch.arange(k) // size
        return fmt.IntCodes(codes.t(), zeros.t(), tensors["scales"].t(), group)


def _columns(words: torch.Tensor, what: str) -> torch.Tensor:
    """[R, N / 8] AWQ words -> [R, N] codes in column order."""
    nibbles = fmt.unpack_int32(words, 1, what)  # nibble order
    r, n = nibbles.shape
    return nibbles.view(r, n // fmt.PER_WORD, fmt.PER_WORD)[:, :, list(UNORDER)].reshape(r, n)


class AwqConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, ignored: list[str] | None = None) -> None:
        super().__init__(ignored)
        self.format = AwqFormat(group_size)

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> AwqConfig:
        bits = data.get("bits", data.get("w_bit"))
        version = str(data.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or data.get("zero_point", True) is not True:
            raise ValueError(f"AWQ bits={bits}, version={version!r}, zero_point="
                             f"{data.get('zero_point', True)} is not supported (supported: "
                             "4 bits, the gemm layout, with zero points)")
        group = int(data.get("group_size", data.get("q_group_size", 128)))
        return cls(group, list(data.get("modules_to_not_convert") or []))

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]) -> Any:
        if prefix == "lm_head" or self.is_ignored(hf_names):
            return None
        return packed_method(self.format, layer, prefix, hf_names)

    def check_model(self, model: nn.Module) -> None:
        check_family(model, "AWQ")

