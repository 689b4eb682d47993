"""GGUF linears kept quantized: each linear holds its checkpoint's blocks decoded to integer codes
with per-group scales (`gguf_codes.py`) in the W4A16 kernel's layout, on the device, and
multiplies with that kernel (`ops/w4a16_gemm.py`): 4-bit types as 4-bit codes, Q5_K, Q6_K and
Q8_0 as 8-bit ones.

`--quantization gguf` (or, on CUDA, the default for a .gguf model with
PAGEDSERVE_GGUF_KERNEL=1) makes the GGUF reader hand every linear's weight over undecoded, as a
`GGUFWeight`; everything else (embedding, norms) is dequantized at load as before. Types with a
kernel: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K (those of Q4_K_M files and of the bundled SmolLM2).
A layer with a part of any other type (F16, Q5_0, Q3_K, IQ*, ...) is dequantized at load into
the model dtype, whole, and the start-up log names the type. The parts of a fused layer (q, k,
v; gate, up) of one type are stacked into one weight; parts of different types (a Q4_K_M file's
Q6_K v beside Q4_K q and k) each keep their own, and the layer's product writes each part's
columns.

Tensor parallelism cuts the blocks before anything else, through the layer's own `rank_part`
(`GGUFWeight.narrow`): blocks run along the inputs, so a column-parallel layer (q/k/v, gate/up,
each part its rank's rows; the head's vocabulary rows, padded with zero bytes) takes whole
rows, and a row-parallel one (o, down) takes whole blocks of each row, 32 inputs for
Q8_0/Q4_0/Q4_1 and 256 for the K-quants: a rank's share that is not whole blocks is refused
naming the layer, the tensor, its type and the sizes. The kept and the dequantized layers then
see only their rank's part, so CUDA's GEMMs and the dequantize-at-load path shard alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagedserve.quantization.base import LinearMethod, QuantizationConfig
from pagedserve.quantization.gguf_types import BLOCKS, Q4_1, Q4_K, Q5_K, Q6_K
from pagedserve.quantization.unquantized import UNQUANTIZED, load_float

if TYPE_CHECKING:  # the kernel's module imports triton: only when a layer keeps its blocks
    from pagedserve.quantization.ops.w4a16_gemm import W4A16Weight


@dataclass
class GGUFWeight:
    """A checkpoint weight as the GGUF file stores it: `data` [rows, bytes per row] of block
    type `qtype` (ggml's id; a float array for F32/F16), `shape` (out, in) in Hugging Face
    order, `name` the file's tensor name."""

    qtype: int
    data: np.ndarray
    shape: tuple[int, int]
    name: str

    @property
    def type_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.qtype).name

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in] on the CPU (gguf's own dequantizer)."""
        values = dequantize_array(self.data, self.qtype, self.name)
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(self.shape))

    @property
    def block_size(self) -> int:
        """Inputs per block (1 for F32/F16/BF16)."""
        import gguf

        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.qtype)][0]

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Output rows `start:start + length` (dim 0: each row is whole blocks, any rows split
        cleanly) or inputs (dim 1, a row-parallel rank's slice: whole blocks only, else an
        error naming the tensor, its type and the sizes). What a tensor-parallel layer's
        `rank_part` takes of the weight."""
        rows, cols = self.shape
        if dim == 0:
            return GGUFWeight(self.qtype, self.data[start:start + length], (length, cols),
                              self.name)
        block = self.block_size
        if start % block or length % block:
            raise ValueError(
                f"GGUF tensor {self.name} ({self.type_name}, {rows} outputs x {cols} inputs) "
                f"cannot split its inputs {length} per rank (tensor_parallel_size "
                f"{cols // length}): a rank must hold whole {self.type_name} blocks of {block} "
                f"inputs and a row has {cols // block}; use a tensor_parallel_size that "
                f"divides {cols // block}")
        width = self.data.shape[1] // (cols // block)  # data columns per block
        data = self.data[:, start // block * width:(start + length) // block * width]
        return GGUFWeight(self.qtype, np.ascontiguousarray(data), (rows, length), self.name)

    def with_zero_rows(self, count: int) -> GGUFWeight:
        """`count` rows of zero bytes appended: every type's zero bytes decode to zeros (zero
        scales, zero mins), as a padded vocabulary's rows must."""
        pad = np.zeros((count, self.data.shape[1]), dtype=self.data.dtype)
        return GGUFWeight(self.qtype, np.concatenate([self.data, pad]),
                          (self.shape[0] + count, self.shape[1]), self.name)


def dequantize_array(data: np.ndarray, qtype: int, name: str) -> np.ndarray:
    """A GGUF tensor's data (blocks, or F32/F16 values) as float32 numpy (gguf's dequantizer;
    a read-only view of the memory map for F32); `name`: the file's tensor, for errors."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(qtype)
    fast = _dequantize_in_torch(data, qtype.name)
    if fast is not None:
        return fast
    try:
        return dequantize(data, qtype)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {name!r} is stored as {qtype.name}, "
                         "which pagedserve cannot dequantise") from None


# The bundled SmolLM2's block types, Q4_0, and the K types (Q4_K_M's, Q5_K_M's), decoded in torch
# (`gguf_codes`: the same float32 operations as gguf's numpy dequantizer, so the same bits) in a
# third of its time: loading the bundled model spent ~1 s there, an 8B Q4_K_M file ~2 minutes
# on a 2-core machine. These are the types kept on CUDA too (gguf_types.BLOCKS).
_TORCH_TYPES = {name: qtype for qtype, (_, _, name) in BLOCKS.items()}


def _dequantize_in_torch(data: np.ndarray, type_name: str) -> np.ndarray | None:
    qtype = _TORCH_TYPES.get(type_name)
    if qtype is None:
        return None
    from pagedserve.quantization.gguf_codes import gguf_codes

    block, size, _ = BLOCKS[qtype]
    raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).reshape(-1, data.shape[-1])
    values = gguf_codes(raw, qtype, data.shape[-1] // size * block).dequantize()
    return values.numpy().reshape(*data.shape[:-1], -1)


class GgufLinearMethod(LinearMethod):
    """A linear whose weight parts arrive as `GGUFWeight`s."""

    takes_gguf_blocks = True

    def __init__(self) -> None:
        self.name = "gguf"

    def create_weights(self, layer: nn.Linear, dtype: torch.dtype) -> None:
        layer.model_dtype = dtype
        layer.gguf_parts = {}  # shard -> (rows in the layer or None, GGUFWeight)
        # No float weight unless the layer ends up dequantized.
        layer.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=layer.weight.device),
                                    requires_grad=False)

    def load(self, layer: nn.Linear, name: str, tensor: Any, shard: str | None,
             rows: tuple[int, int] | None) -> None:
        if name != "weight":
            load_float(layer, name, tensor, shard, rows)
            return
        what = getattr(layer, "prefix", "a layer")
        if not isinstance(tensor, GGUFWeight):
            raise ValueError(f"{what}.weight reached the GGUF method as a float tensor: only a "
                             ".gguf file's weights can")
        try:  # this rank's rows (column-parallel) or whole blocks of inputs (row-parallel)
            tensor = layer.rank_part(tensor, name, shard)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        size = rows[1] if rows is not None else layer.out_features
        if tensor.shape != (size, layer.in_features):
            raise ValueError(f"GGUF tensor {tensor.name} has shape {tensor.shape}, the model "
                             f"expects {(size, layer.in_features)}")
        layer.gguf_parts[shard] = (rows, tensor)

    def process_after_loading(self, layer: nn.Linear) -> None:
        parts = sorted(layer.gguf_parts.values(), key=lambda p: p[0][0] if p[0] else 0)
        del layer.gguf_parts
        types = sorted({w.type_name for _, w in parts})
        outside = sorted({w.type_name for _, w in parts if w.qtype not in BLOCKS})
        device = layer.weight.device
        rows = sum(w.shape[0] for _, w in parts)
        if rows != layer.out_features:  # the loader's coverage check makes this unlikely
            raise ValueError(f"{getattr(layer, 'prefix', 'a layer')}: its GGUF parts have "
                             f"{rows} rows, the layer {layer.out_features}")
        if outside:
            self.name = f"gguf {'+'.join(outside)}: no kernel, dequantized at load"
            layer.weight = nn.Parameter(torch.cat([w.dequantize() for _, w in parts])
                                        .to(device=device, dtype=layer.model_dtype),
                                        requires_grad=False)
            return
        self.name = f"gguf {'+'.join(types)} -> W4A16 kernel"
        layer.gguf_types, layer.gguf_w4a16 = _stack(parts, layer.in_features, device)
        for i, part in enumerate(layer.gguf_w4a16):  # counted in the module's memory
            for name, tensor in part.tensors().items():
                layer.register_buffer(f"gguf{i}_{name}", tensor, persistent=False)
        del layer.weight
        layer.register_parameter("weight", None)

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        if layer.weight is None:
            from pagedserve.quantization.ops.w4a16_gemm import w4a16_linear

            return w4a16_linear(x, layer.gguf_w4a16, bias)
        return UNQUANTIZED.apply(layer, x, bias)


def _stack(parts: list[tuple[Any, GGUFWeight]], in_features: int, device: torch.device
           ) -> tuple[list[str], list[W4A16Weight]]:
    """Consecutive parts of one block type as one weight (their rows concatenated), decoded
    on the device into the W4A16 layout: (each weight's block type, the weights)."""
    from pagedserve.quantization.gguf_codes import check_blocks, gguf_codes

    runs: list[list[GGUFWeight]] = []
    for _, weight in parts:
        if runs and runs[-1][0].qtype == weight.qtype:
            runs[-1].append(weight)
        else:
            runs.append([weight])
    stacked = []
    for run in runs:
        data = torch.from_numpy(np.concatenate([w.data for w in run])).to(device)
        check_blocks(run[0].qtype, data, in_features)
        stacked.append(gguf_codes(data, run[0].qtype, in_features).w4a16())
    return [run[0].type_name for run in runs], stacked


class GgufConfig(QuantizationConfig):
    """`--quantization gguf`: every linear of a .gguf model keeps its blocks."""

    name = "gguf"

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]
                   ) -> LinearMethod | None:
        return GgufLinearMethod() if isinstance(layer, nn.Linear) else None

    def check_model(self, model: nn.Module) -> None:
        if not getattr(model, "supports_quantized_checkpoints", False):
            raise ValueError(f"GGUF blocks kept quantized are not supported for "
                             f"{type(model).__name__}; use --quantization none")


def random_blocks(qtype: int, rows: int, cols: int, generator: torch.Generator,
                  scale: float = 1e-3) -> torch.Tensor:
    """Valid blocks of random codes for a [rows, cols] weight of block type `qtype` (uint8
    [rows, bytes per row], on the generator's device): every byte random except the float16
    scales, set to finite values below `scale` (random bytes there would be NaN or huge). For
    tests and benchmarks."""
    block, size, _ = BLOCKS[qtype]
    device = generator.device
    data = torch.randint(0, 256, (rows, cols // block, size), generator=generator,
                         dtype=torch.uint8, device=device)
    offsets = {Q6_K: (208,), Q4_1: (0, 2), Q4_K: (0, 2), Q5_K: (0, 2)}.get(qtype, (0,))
    for offset in offsets:
        d = torch.rand(rows, cols // block, generator=generator, device=device) * scale
        data[:, :, offset:offset + 2] = d.to(torch.float16).view(torch.uint8) \
            .view(rows, cols // block, 2)
    return data.view(rows, -1)
