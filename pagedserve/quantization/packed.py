"""Packed integer weights (AWQ, GPTQ and compressed-tensors int4 / int8, MXFP4; and
compressed-tensors' unpacked int8) dequantized at load.

Each format is a `PackedFormat`: the tensors a checkpoint gives per weight (codes, scales,
zero points, a group index) and how they become a float32 [out, in] weight. The layers' methods
here stage those tensors as they arrive, part by part (q, k, v; gate, up) and expert by expert,
and once every tensor is in, dequantize each whole checkpoint weight and copy this rank's part
of it into the layer's float weight, in the model's dtype. The product is then the float
layer's: the CPU runs every format this way, exactly (see int_codes.py). On CUDA, with
`PAGEDSERVE_W4A16_KERNEL=1`, an integer format's linears instead keep their codes for the
W4A16 kernel (`w4a16.py`, 4- or 8-bit codes; a fused layer whose parts' groups differ is
dequantized), and every 4-bit format's experts, act-order ones too, theirs for the 4-bit MoE
kernel (`w4_moe.py`, which refuses 8-bit experts by name).

A float `weight` where the config says packed, a tensor of another format, a missing one (the
loader's coverage check) or a shape that does not fit are refused naming the tensor.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve import envs
from pagedserve.quantization import int_codes as fmt
from pagedserve.quantization.base import LinearMethod, MoEMethod
from pagedserve.quantization.unquantized import (
    UNQUANTIZED,
    UNQUANTIZED_MOE,
    expert_destination,
    load_float,
)


class PackedFormat:
    """One checkpoint format's tensors and their dequantization."""

    # Logged at start-up with the layers that use it.
    name: ClassVar[str] = "?"

    def checkpoint_tensors(self) -> tuple[str, ...]:
        """The tensors every packed weight comes with."""
        raise NotImplementedError

    def optional_tensors(self) -> tuple[str, ...]:
        """Tensors a checkpoint may add (read when present)."""
        return ()

    def unpack(self, tensors: dict[str, torch.Tensor], what: str) -> fmt.IntCodes | None:
        """The staged tensors of one checkpoint weight as integer codes, zero points, scales
        and groups (what the W4A16 kernel reads); None: the format is not integer (MXFP4).
        `what` names the weight (its module) in errors."""
        return None

    def dequantize(self, tensors: dict[str, torch.Tensor], what: str) -> torch.Tensor:
        """The staged tensors of one checkpoint weight -> float32 [out, in]."""
        return self.unpack(tensors, what).dequantize()


def _stage(staged: dict, key: Any, fmt_: PackedFormat, name: str, tensor: Any,
           what: str) -> None:
    if name not in (*fmt_.checkpoint_tensors(), *fmt_.optional_tensors()):
        hint = (" (a float weight: is the layer missing from the config's list of modules "
                "left unquantized?)" if name == "weight" else "")
        raise ValueError(f"checkpoint tensor {what}.{name} is not part of {fmt_.name} "
                         f"(expected {', '.join(fmt_.checkpoint_tensors())}){hint}")
    staged.setdefault(key, {})[name] = fmt.tensor(tensor)


# The tests set this to run the W4A16 kernel's layout on CPU tensors (the Triton interpreter);
# serving on the CPU dequantizes.
KERNELS_ON_CPU = False


class PackedLinearMethod(LinearMethod):
    """A linear whose checkpoint weight is packed; `hf_names`: the checkpoint's module names
    of its parts (for errors); `dequantize`: always into the model dtype (a weight another
    module reads, such as DeepSeek's `kv_b_proj`)."""

    def __init__(self, packed: PackedFormat, hf_names: list[str], dequantize: bool = False
                 ) -> None:
        self.packed = packed
        self.hf_names = hf_names
        self.dequantize = dequantize
        self.name = f"{packed.name}, dequantized at load"

    def create_weights(self, layer: nn.Linear, dtype: torch.dtype) -> None:
        layer.model_dtype = dtype
        layer.packed_parts = {}  # shard -> {tensor name: full checkpoint tensor}
        layer.packed_rows = {}  # shard -> its rows in this rank's layer (None: all)
        # No float weight until the codes are in (a kernel may never need one); the empty
        # parameter keeps its name, by which the loader lists the layer's checkpoint tensors.
        layer.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=layer.weight.device),
                                    requires_grad=False)

    def checkpoint_tensors(self, layer: nn.Linear) -> tuple[str, ...]:
        bias = ("bias",) if layer.bias is not None else ()
        return (*self.packed.checkpoint_tensors(), *bias)

    def load(self, layer: nn.Linear, name: str, tensor: Any, shard: str | None,
             rows: tuple[int, int] | None) -> None:
        if name == "bias":
            load_float(layer, name, tensor, shard, rows)
            return
        layer.packed_rows[shard] = rows
        _stage(layer.packed_parts, shard, self.packed, name, tensor, self.part_name(shard))

    def process_after_loading(self, layer: nn.Linear) -> None:
        staged, rows = layer.packed_parts, layer.packed_rows
        del layer.packed_parts, layer.packed_rows
        device = layer.weight.device
        # The kernel has not run on a GPU yet: CUDA takes it only when asked
        # (PAGEDSERVE_W4A16_KERNEL=1), and dequantizes at load otherwise.
        on_cuda = device.type == "cuda" and envs.PAGEDSERVE_W4A16_KERNEL
        if not self.dequantize and (on_cuda or KERNELS_ON_CPU):
            from pagedserve.quantization.w4a16 import use_kernel

            if use_kernel(layer, self, staged, rows):
                self.name = f"{self.packed.name} -> W{layer.w4a16.bits}A16 kernel"
                return
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=layer.model_dtype, device=device),
                                    requires_grad=False)
        for shard, tensors in staged.items():
            what = self.part_name(shard)
            weight = self.packed.dequantize(tensors, what).to(layer.model_dtype)
            try:
                load_float(layer, "weight", weight, shard, rows[shard])
            except ValueError as e:
                raise ValueError(f"{what} dequantized: {e}") from None

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        if layer.weight is None:
            from pagedserve.quantization.ops.w4a16_gemm import w4a16_linear

            return w4a16_linear(x, layer.w4a16, bias)
        return UNQUANTIZED.apply(layer, x, bias)

    def part_name(self, shard: str | None) -> str:
        """The checkpoint module of part `shard` (q -> ...q_proj, gate -> ...gate_proj)."""
        if shard is not None:
            for name in self.hf_names:
                if name.rpartition(".")[2].startswith(shard):
                    return name
        return self.hf_names[0] if len(self.hf_names) == 1 else ",".join(self.hf_names)


_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


class PackedMoEMethod(MoEMethod):
    """Experts whose weights are packed, one checkpoint weight per expert and projection."""

    def __init__(self, packed: PackedFormat) -> None:
        self.packed = packed
        self.name = f"{packed.name} experts, dequantized at load"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.model_dtype = dtype
        layer.packed_parts = {}  # (expert, shard) -> {tensor name: full checkpoint tensor}
        # No float experts until the codes are in (the 4-bit kernel may never need them).
        layer.expert_shapes = {}
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(layer, name)
            layer.expert_shapes[name] = tuple(param.shape)
            setattr(layer, name, nn.Parameter(torch.empty(0, dtype=dtype, device=param.device),
                                              requires_grad=False))

    def checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        return self.packed.checkpoint_tensors()

    def load_expert(self, layer: nn.Module, expert: int, shard: str, name: str,
                    tensor: Any) -> None:
        _stage(layer.packed_parts, (expert, shard), self.packed, name, tensor,
               _expert_name(layer, expert, shard))

    def process_after_loading(self, layer: nn.Module) -> None:
        staged, shapes = layer.packed_parts, layer.expert_shapes
        del layer.packed_parts, layer.expert_shapes
        device = layer.gate_up_proj.device
        # As the linears: CUDA takes the 4-bit kernel only when asked (PAGEDSERVE_W4A16_KERNEL).
        if (device.type == "cuda" and envs.PAGEDSERVE_W4A16_KERNEL) or KERNELS_ON_CPU:
            from pagedserve.quantization.w4_moe import use_moe_kernel

            if use_moe_kernel(layer, self.packed, staged, shapes):
                self.name = f"{self.packed.name} experts -> 4-bit MoE kernel"
                return
        for name, shape in shapes.items():
            setattr(layer, name, nn.Parameter(torch.empty(shape, dtype=layer.model_dtype,
                                                          device=device), requires_grad=False))
        for (expert, shard), tensors in staged.items():
            what = _expert_name(layer, expert, shard)
            weight = self.packed.dequantize(tensors, what).to(layer.model_dtype)
            part = layer.rank_part(weight, "", shard)
            param = layer.down_proj if shard == "down" else layer.gate_up_proj
            dst = expert_destination(layer, param, expert, shard)
            if dst.shape != part.shape:
                raise ValueError(f"{what} dequantized has shape {tuple(part.shape)}, the "
                                 f"model expects {tuple(dst.shape)}")
            dst.copy_(part)

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "w4_experts", None) is not None:
            from pagedserve.quantization.ops.w4_moe_kernels import w4_fused_experts

            return w4_fused_experts(x, *layer.w4_experts, weights, ids, layer.activation,
                                    layer.gate_up_proj_bias, layer.down_proj_bias)
        return UNQUANTIZED_MOE.apply(layer, x, weights, ids)


def _expert_name(layer: nn.Module, expert: int, shard: str) -> str:
    return f"{getattr(layer, 'prefix', 'experts')}.{expert}.{_PROJ[shard]}"


def packed_method(packed: PackedFormat, layer: nn.Module, prefix: str, hf_names: list[str]
                  ) -> PackedLinearMethod | PackedMoEMethod | None:
    """The packed method for a linear or a `FusedMoE`; None for any other layer."""
    from pagedserve.models.moe import FusedMoE

    if isinstance(layer, nn.Linear):
        # Multi-head latent attention absorbs kv_b_proj into its query and output: it reads
        # the float weight.
        return PackedLinearMethod(packed, hf_names, dequantize=prefix.endswith("kv_b_proj"))
    if isinstance(layer, FusedMoE):
        return PackedMoEMethod(packed)
    return None


def check_family(model: nn.Module, what: str) -> None:
    if not getattr(model, "supports_quantized_checkpoints", False):
        raise ValueError(f"{what} checkpoints are not supported for {type(model).__name__} "
                         "yet")
