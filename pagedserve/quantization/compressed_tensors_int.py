"""What compressed-tensors' weight-only integer schemes share (pack-quantized int4 / int8 and
unpacked int8): reading one config group's weight strategy, group size, symmetry and act-order,
and the config that holds the checkpoint's one scheme and hands each linear its packed method.
Each scheme's module says which strategies, widths and tensors it takes."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.quantization.base import QuantizationConfig
from pagedserve.quantization.packed import PackedFormat, check_family, packed_method

# compressed-tensors' act-order names: "group" needs the g_idx, "weight" keeps the groups in
# input order (only the quantization order changed); "dynamic" and "static" are their aliases.
ACTORDER = {None: None, "group": "group", "dynamic": "group", "weight": "weight",
            "static": "weight"}


def weight_scheme(weights: dict[str, Any], strategies: tuple[str, ...], widths: tuple[int, ...],
                  refuse: str) -> tuple[int | None, bool, bool]:
    """(group size: -1 per channel, None per tensor; symmetric; act-order g_idx) of a config
    group's `weights`; `refuse` is the message (naming what is supported) for anything else."""
    strategy = weights.get("strategy")
    actorder = weights.get("actorder")
    if weights.get("num_bits") not in widths or weights.get("type") != "int" \
            or weights.get("dynamic") or strategy not in strategies or actorder not in ACTORDER:
        raise ValueError(refuse)
    size = {"tensor": None, "channel": -1}.get(strategy)
    if strategy == "group":
        size = int(weights.get("group_size") or 0)
        if size <= 0:
            raise ValueError(f"compressed-tensors group weights need a group_size, got "
                             f"{weights.get('group_size')}")
    return size, bool(weights.get("symmetric", True)), ACTORDER[actorder] == "group"


def brief(weights: dict[str, Any]) -> dict[str, Any]:
    """The fields of a config group's `weights` that a refusal names."""
    return {k: weights.get(k) for k in ("num_bits", "type", "strategy", "actorder")}


class CompressedTensorsIntConfig(QuantizationConfig):
    """One integer scheme for every config group (mixed schemes are refused by name); each
    subclass reads a group into its format's arguments (`scheme`)."""

    name = "compressed-tensors"
    format_type: type[PackedFormat]

    def __init__(self, format_: PackedFormat, ignored: list[str]) -> None:
        super().__init__(ignored)
        self.format = format_

    @staticmethod
    def scheme(group: dict[str, Any], format_name: str | None) -> tuple:
        """The format's constructor arguments for one config group, or a ValueError naming
        what is not supported."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> CompressedTensorsIntConfig:
        groups = list((data.get("config_groups") or {}).values())
        if not groups:
            raise ValueError("compressed-tensors config has no config_groups")
        schemes = {cls.scheme(group, data.get("format")) for group in groups}
        if len(schemes) > 1:
            names = sorted(cls.format_type(*s).name for s in schemes)
            raise ValueError("compressed-tensors config groups with different schemes are not "
                             f"supported: {names}")
        return cls(cls.format_type(*schemes.pop()), list(data.get("ignore") or []))

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]) -> Any:
        if self.is_ignored(hf_names):
            return None
        return packed_method(self.format, layer, prefix, hf_names)

    def check_model(self, model: nn.Module) -> None:
        check_family(model, f"compressed-tensors int{self.format.bits}")
