"""FP8 linears on CUDA: which kernel a layer runs, chosen once after loading and logged at
start-up, and the forward for each.

- "scaled_mm": per-channel weight scales (per-tensor checkpoints become one scale per row, the
  part's own) with activations quantized per token (dynamic) or by the checkpoint's
  `input_scale` (static): cuBLASLt's rowwise-scaled FP8 GEMM through `torch._scaled_mm`,
  bias and output dtype in the same call.
- "triton_block": 128 x 128 weight blocks with 1 x 128 activation groups: our Triton GEMM
  (`ops/fp8_block_gemm.py`).
- at decode (rows <= `ops/fp8_small_m.SMALL_M_MAX`, 16) both layouts run our small-M kernel
  instead (`ops/fp8_small_m.py`): it streams the e4m3 weight once and reads x as it comes (the
  model's dtype, unquantized, or a fused producer's FP8 codes and scales), where cuBLASLt pads
  M to 16 and the activation quantization costs launches of its own.
- "dequantized": what neither kernel takes (weight-only FP8 checkpoints, dimensions
  `_scaled_mm` refuses, block widths that are not powers of two): the weight dequantized into
  the model's dtype at load; the log names the layers that got it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quantization import fp8_format as fmt
from pagedserve.quantization.fp8_format import Fp8Scheme

SCALED_MM = "scaled_mm"
TRITON_BLOCK = "triton_block"
DEQUANTIZED = "dequantized"
# cuBLASLt's FP8 GEMM wants both dimensions of the weight in multiples of 16.
_ALIGN = 16
# The tests set this to run the kernels' layouts on CPU tensors (`torch._scaled_mm` has a CPU
# path, the Triton kernels run in the interpreter); serving on the CPU dequantizes.
KERNELS_ON_CPU = False


def kernels_on(device: torch.device) -> bool:
    """Whether FP8 layers on `device` keep their codes for a kernel (else: dequantized)."""
    return device.type == "cuda" or KERNELS_ON_CPU


def choose_kernel(scheme: Fp8Scheme, layer: nn.Linear) -> str:
    """The kernel for a layer whose FP8 codes and scales are laid out for `scheme` (channel or
    block); a layer neither kernel takes is dequantized here and says so."""
    n, k = layer.weight.shape
    if scheme.activation != "none":
        if scheme.weight == "channel" and n % _ALIGN == 0 and k % _ALIGN == 0:
            return SCALED_MM
        if scheme.weight == "block" and _power_of_two(scheme.block[1]) and scheme.block[1] >= 16:
            return TRITON_BLOCK
    scale = layer.weight_scale
    w = fmt.dequantize(layer.weight.data, scale, scheme if scheme.weight == "block"
                       else Fp8Scheme("channel"))
    layer.weight = nn.Parameter(w.to(layer.model_dtype), requires_grad=False)
    del layer.weight_scale
    return DEQUANTIZED


def kernel_takes(scheme: Fp8Scheme) -> bool:
    """Whether a kernel can read the layer in FP8 (else it is dequantized at load): activations
    to quantize, and a block width the Triton GEMM steps through (a power of two, >= 16)."""
    if scheme.activation == "none":
        return False
    return scheme.weight != "block" or (_power_of_two(scheme.block[1]) and scheme.block[1] >= 16)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def input_group(layer: nn.Linear) -> int | None:
    """The activation group a layer's kernel reads (in_features: per token), or None where it
    quantizes its input itself (a static input scale) or reads the model's dtype."""
    if layer.fp8_kernel == SCALED_MM and layer.input_scale is None:
        return layer.in_features
    if layer.fp8_kernel == TRITON_BLOCK:
        return layer.fp8_scheme.block[1]
    return None


def apply_fp8(layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's kernel on x, in the model's dtype or already FP8 (`Fp8Activation`, from a
    fused norm or SiLU-and-mul in the group `input_group` asked for)."""
    from pagedserve.quantization.ops.fp8_fused import Fp8Activation

    if isinstance(x, Fp8Activation):
        if x.group != input_group(layer):
            raise ValueError(f"{getattr(layer, 'prefix', 'layer')}: FP8 input in groups of "
                             f"{x.group}, the kernel reads {input_group(layer)}")
        return _apply_quantized(layer, x, bias)
    if layer.fp8_kernel in (SCALED_MM, TRITON_BLOCK) and _small_m_on(x):
        from pagedserve.quantization.ops import fp8_small_m

        if x.numel() <= fp8_small_m.SMALL_M_MAX * x.shape[-1]:
            flat = x.reshape(-1, x.shape[-1])
            out = fp8_small_m.small_m_linear(flat, layer.weight, layer.weight_scale, bias,
                                             block=_block(layer))
            return out.reshape(*x.shape[:-1], out.shape[-1])
    if layer.fp8_kernel == SCALED_MM:
        return scaled_mm_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias)
    if layer.fp8_kernel == TRITON_BLOCK:
        from pagedserve.quantization.ops.fp8_block_gemm import fp8_block_linear

        return fp8_block_linear(x, layer.weight, layer.weight_scale, layer.fp8_scheme.block,
                                bias)
    return F.linear(x, layer.weight, bias)


def _small_m_on(x: torch.Tensor) -> bool:
    return x.is_cuda or KERNELS_ON_CPU


def _block(layer: nn.Linear) -> tuple[int, int] | None:
    return layer.fp8_scheme.block if layer.fp8_kernel == TRITON_BLOCK else None


def _apply_quantized(layer: nn.Linear, x, bias: torch.Tensor | None) -> torch.Tensor:
    if _small_m_on(x.q):
        from pagedserve.quantization.ops import fp8_small_m

        if x.q.shape[0] <= fp8_small_m.SMALL_M_MAX:
            return fp8_small_m.small_m_linear(x.q, layer.weight, layer.weight_scale, bias,
                                              block=_block(layer), x_scale=x.scale,
                                              x_group=x.group, out_dtype=x.dtype)
    if layer.fp8_kernel == SCALED_MM:
        return _scaled_mm(x.q, x.scale, layer.weight, layer.weight_scale, bias, x.dtype)
    from pagedserve.quantization.ops.fp8_block_gemm import block_scaled_mm

    out = block_scaled_mm(x.q, x.scale, layer.weight, layer.weight_scale,
                          layer.fp8_scheme.block, x.dtype)
    return out if bias is None else out + bias


def quantize_per_token(x: torch.Tensor, input_scale: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]): each row by its own maximum, or every
    row by the static `input_scale`. One Triton launch where the kernels run
    (`ops/fp8_token_quant.py`, the same bits), else `quantize_per_token_reference`."""
    if x.is_cuda or KERNELS_ON_CPU:
        from pagedserve.quantization.ops.fp8_token_quant import quantize_per_token_triton

        return quantize_per_token_triton(x, input_scale)
    return quantize_per_token_reference(x, input_scale)


def quantize_per_token_reference(x: torch.Tensor, input_scale: torch.Tensor | None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token` in torch ops (about six passes over x)."""
    xf = x.float()
    if input_scale is None:
        # Times the reciprocal: what torch's CUDA division by a Python scalar computes (its
        # CPU division does not), so the scale is the same bits on every device and in the
        # Triton kernel.
        amax = xf.abs().amax(dim=1, keepdim=True)
        scale = (amax * (1.0 / fmt.FP8_MAX)).clamp_min(fmt.MIN_SCALE)
    else:
        scale = input_scale.reshape(1, 1).expand(x.shape[0], 1)
    q = (xf / scale).clamp(-fmt.FP8_MAX, fmt.FP8_MAX).to(fmt.FP8)
    return q, scale.contiguous()


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype through `torch._scaled_mm` (rowwise scales)."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = quantize_per_token(flat, input_scale)
    out = _scaled_mm(q, scale, weight, weight_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _scaled_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
               ) -> torch.Tensor:
    # cuBLASLt's rowwise-scaled FP8 GEMM writes bfloat16 only: other dtypes (fp16, float32
    # tests on a GPU) are cast after.
    out_dtype = torch.bfloat16 if q.is_cuda else dtype
    if bias is not None:
        bias = bias.to(out_dtype)
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.reshape(1, -1),
                           bias=bias, out_dtype=out_dtype)
    return out.to(dtype)
