"""FP8 (e4m3) weights as checkpoints store them, and the arithmetic on them that every device
shares: dequantizing a weight of any granularity, quantizing one per channel (online FP8), and
taking a tensor-parallel rank's part of a scale.

Granularities (`Fp8Scheme.weight`): "tensor" (one scale per checkpoint tensor, so one per part
of a fused layer), "channel" (one per output row), "block" (one per `block` [rows, cols] tile,
DeepSeek's [128, 128]). A weight whose size is not a multiple of the block has a partial block
at its edge, which DeepSeek quantized as if zero-padded to the full block: row i, column j reads
scale[i // 128, j // 128] (transformers' CPU dequantization instead spreads the scale rows over
N / scale-rows rows, which differs for a partial block; we follow DeepSeek's reading).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# A scale of zero (an all-zero row) would divide by zero when quantizing.
MIN_SCALE = 1e-12

WEIGHT_GRANULARITIES = ("tensor", "channel", "block")
ACTIVATIONS = ("dynamic", "static", "none")


@dataclass(frozen=True)
class Fp8Scheme:
    """How one layer's FP8 weights are stored and its activations quantized.

    weight: a granularity above; block: its [rows, cols] for "block"; activation: "dynamic"
    (per token, or per 1 x block-cols group with block weights), "static" (one checkpoint
    `input_scale` per tensor) or "none" (weight-only: activations stay in the model dtype);
    scale_name: what the checkpoint calls the weight's scale; online: the checkpoint is float
    and the weights are quantized at load."""

    weight: str
    activation: str = "dynamic"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    online: bool = False

    def __post_init__(self) -> None:
        if self.weight not in WEIGHT_GRANULARITIES:
            raise ValueError(f"FP8 weight granularity {self.weight!r} is not one of "
                             f"{', '.join(WEIGHT_GRANULARITIES)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"FP8 activations {self.activation!r} are not one of "
                             f"{', '.join(ACTIVATIONS)}")
        if (self.weight == "block") != (self.block is not None):
            raise ValueError("FP8 block weights need a block size, and only they take one")

    def describe(self) -> str:
        weight = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per {self.weight}"
        return f"FP8 weights {weight}, activations {self.activation}" + \
            (" (quantized at load)" if self.online else "")

    def checkpoint_scales(self) -> tuple[str, ...]:
        """The scale tensors a checkpoint gives beside each weight."""
        if self.online:
            return ()
        return (self.scale_name, "input_scale") if self.activation == "static" \
            else (self.scale_name,)


def expected_scale_shape(scheme: Fp8Scheme, rows: int, cols: int) -> tuple[int, ...]:
    """The scale's shape for a [rows, cols] weight (a channel scale may also come as
    [rows, 1], a tensor scale as [1] or []; `check_scale` accepts those)."""
    if scheme.weight == "tensor":
        return ()
    if scheme.weight == "channel":
        return (rows,)
    return (math.ceil(rows / scheme.block[0]), math.ceil(cols / scheme.block[1]))


def check_scale(scheme: Fp8Scheme, scale: torch.Tensor, rows: int, cols: int,
                what: str) -> torch.Tensor:
    """`scale` as float32 in its canonical shape, or a clear error naming the shapes."""
    want = expected_scale_shape(scheme, rows, cols)
    got = tuple(scale.shape)
    if scheme.weight == "tensor" and scale.numel() == 1:
        return scale.reshape(()).float()
    if scheme.weight == "channel" and got in ((rows,), (rows, 1)):
        return scale.reshape(rows).float()
    if scheme.weight == "block" and got == want:
        return scale.float()
    raise ValueError(f"{what} has shape {got}; a [{rows}, {cols}] weight with "
                     f"{scheme.describe()} needs {want or '(1,)'}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """An FP8 weight [N, K] and its canonical float32 scale -> float32 [N, K]."""
    w = weight.float()
    if scheme.weight == "tensor":
        return w * scale
    if scheme.weight == "channel":
        return w * scale[:, None]
    bn, bk = scheme.block
    n, k = w.shape
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return w * full[:n, :k]


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes [N, K], float32 scale [N]) of a float weight, one scale per output row
    (online FP8)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes [N, K], float32 scale [ceil(N/bn), ceil(K/bk)]) of a float weight, the edge
    blocks zero-padded: for re-quantizing a fused layer whose parts do not align to blocks."""
    bn, bk = block
    n, k = weight.shape
    rn, rk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(rn * bn, rk * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    tiles = padded.view(rn, bn, rk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view(rn * bn, rk * bk)[:n, :k].contiguous(), scale


def scale_rank_part(scheme: Fp8Scheme, scale: Any, rank_slice: tuple[int, int, int] | None,
                    what: str) -> torch.Tensor:
    """This rank's part of a full checkpoint scale, given the weight's rank slice (dim,
    start, length); a slice that starts or ends inside a block is an error."""
    from pagedserve.models.parallel import materialize, narrow

    if rank_slice is None or scheme.weight == "tensor":
        return materialize(scale)
    dim, start, length = rank_slice
    if scheme.weight == "channel":
        return narrow(scale, 0, start, length) if dim == 0 else materialize(scale)
    size = scheme.block[dim]
    blocks = scale.shape[dim]
    end = start + length
    if start % size or (end % size and math.ceil(end / size) < blocks):
        axis = "rows" if dim == 0 else "columns"
        raise ValueError(f"{what}: this tensor-parallel rank holds {axis} "
                         f"{start}..{end} of the weight, which splits a {size}-wide FP8 "
                         f"block; use a tensor_parallel_size that divides the layer into "
                         f"whole blocks")
    return narrow(scale, dim, start // size, math.ceil(length / size))
