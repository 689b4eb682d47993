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

It is a `LinearMethod` of every linear, the head included (a tied head gets int8 codes of the
embedding beside the embedding itself: `int8_linear`). `quantization="auto"` chooses it for a
`.gguf` model on the CPU when the dtype is left to the engine: the file's weights were quantized
already (4-bit for the bundled model), so int8 codes of them lose little. Float32 stays one flag
away for exact parity (`--dtype float32` or `--quantization none`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.quantization.base import LinearMethod, QuantizationConfig
from pagedserve.quantization.unquantized import load_float

# The dtype the int8 kernel reads its input and scales in.
KERNEL_DTYPE = torch.bfloat16
# Looked up once: `torch.ops.aten.<name>` resolves the overload on every attribute access,
# microseconds that count at 121 products a token.
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [N, K], bf16 scale [N]) of a float weight, symmetric per output row."""
    w = weight.detach().float()
    # The scale as the kernel reads it, rounded up so no code passes 127; the codes are then
    # exact to half a step of it.
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    scale = (scale * (1 + 2 ** -7)).to(KERNEL_DTYPE)
    codes = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.contiguous(), scale


class Int8LinearMethod(LinearMethod):
    """y = bf16(x) @ (codes * scale)^T + bias, returned in x's dtype (the model's
    activations). The float weight loads as usual and becomes codes after loading."""

    name = "int8 weight-only (CPU)"

    def load(self, layer: nn.Linear, name: str, tensor: Any, shard: str | None,
             rows: tuple[int, int] | None) -> None:
        load_float(layer, name, tensor, shard, rows)

    def process_after_loading(self, layer: nn.Linear) -> None:
        codes, scale = int8_codes(layer.weight)
        layer.register_buffer("codes", codes)
        layer.register_buffer("scale", scale)
        # The float weight is gone: the codes are what the product reads.
        del layer.weight
        layer.register_parameter("weight", None)

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, layer.in_features)
        out = _INT8_MM(flat.to(KERNEL_DTYPE), layer.codes, layer.scale).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], layer.out_features)


INT8 = Int8LinearMethod()


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """A replicated linear of int8 codes of `weight` (a tied head beside its embedding)."""
    from pagedserve.models.parallel import ReplicatedLinear

    with torch.device("meta"):
        layer = ReplicatedLinear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer = layer.to_empty(device=weight.device).to(weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.quant_method = INT8
    INT8.process_after_loading(layer)
    return layer


class Int8Config(QuantizationConfig):
    """`--quantization int8`: every linear weight-only int8, experts left in float."""

    name = "int8"

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]
                   ) -> LinearMethod | None:
        return INT8 if isinstance(layer, nn.Linear) else None

    def check_model(self, model: nn.Module) -> None:
        if not getattr(model, "supports_int8", False):
            raise ValueError(f"int8 weight-only quantization is not supported for "
                             f"{type(model).__name__} (multi-head latent attention, or a family "
                             "without the quantization methods)")

    @property
    def quantizes_tied_head(self) -> bool:
        return True
