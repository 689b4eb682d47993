"""Weight-only int8 linears for the CPU: a decode step there reads every weight once per token,
so memory, not arithmetic, sets its speed.

Each output row keeps int8 codes and one scale (symmetric, per channel), and PyTorch's
`_weight_int8pack_mm` multiplies without dequantizing the matrix. Its fast kernels read
bfloat16 inputs (float32 ones take a path several times slower than float32 weights), so the
layer rounds its input to bfloat16 for the product and hands back the model's dtype. On the
team's 2-core AVX-512 machine the bundled SmolLM2's projections ran 2x faster than in float32
at one token and its tied LM head (49,152 x 576) 7.5x (`benchmarks/cpu_decode.py`).

Batch invariance: the kernel computes each output row from its own input row alone (the same
bits at any number of rows), so the engine keeps everything else in float32 (norms, the
residual stream, attention: see the CPU backend) and a request's greedy tokens do not depend
on what else runs beside it. With bfloat16 everywhere, as before, a last-bit difference in
attention between batch shapes was rounded up to a bfloat16 step and changed greedy text.

`quantization="auto"` chooses it for a `.gguf` model on the CPU when the dtype is left to the
engine: the file's weights were quantized already (4-bit for the bundled model), so int8
codes of them lose little. Float32 stays one flag away for exact parity (`--dtype float32` or
`--quantization none`).
"""

from __future__ import annotations

import torch
from torch import nn

METHODS = ("auto", "none", "int8")


# The dtype the int8 kernel reads its input and scales in.
KERNEL_DTYPE = torch.bfloat16
# Looked up once: `torch.ops.aten.<name>` resolves the overload on every attribute access,
# microseconds that count at 121 products a token.
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


class Int8Linear(nn.Module):
    """y = bf16(x) @ (codes * scale)^T + bias, returned in `dtype` (the model's activations)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        w = weight.detach().float()
        # The scale as the kernel reads it, rounded up so no code passes 127; the codes are
        # then exact to half a step of it.
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        scale = (scale * (1 + 2 ** -7)).to(KERNEL_DTYPE)
        codes = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype),
                                                           requires_grad=False)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = _INT8_MM(flat.to(KERNEL_DTYPE), self.codes, self.scale).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears_(module: nn.Module, dtype: torch.dtype) -> int:
    """Replace every nn.Linear under `module` with an Int8Linear of its weights, in place;
    returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child.weight, child.bias, dtype))
            count += 1
        else:
            count += quantize_linears_(child, dtype)
    return count


def resolve_quantization(method: str | None, model: str | None, dtype: str,
                         device: torch.device) -> str | None:
    """The method to run with: "int8" or None (float weights)."""
    method = (method or "auto").lower()
    if method not in METHODS:
        raise ValueError(f"quantization {method!r} is not one of {', '.join(METHODS)}")
    if method == "int8":
        if device.type != "cpu":
            raise ValueError("quantization 'int8' is the CPU's weight-only path; on "
                             f"{device.type} leave it out")
        return "int8"
    if method == "none" or device.type != "cpu" or dtype != "auto":
        return None
    gguf = model is None or model.endswith(".gguf")  # None: the bundled GGUF
    return "int8" if gguf else None
