"""FP8 linears: checkpoints in DeepSeek's / Qwen's native `quant_method: fp8` format
(per-tensor `weight_scale`, or `weight_block_size` blocks with `weight_scale_inv`), and
`--quantization fp8` of a float checkpoint (per-channel weights, dynamic per-token activations).
compressed-tensors checkpoints reach the same method through their own config.

Each part of a fused layer (q, k, v; gate, up) arrives with its own scale; the method stages
the scales by part and, after loading, either
- dequantizes the weight into the model's dtype (the CPU, and layers the kernels cannot read
  in FP8, such as DeepSeek's `kv_b_proj` that attention absorbs), or
- keeps FP8 codes and lays the scales out for a CUDA kernel (`fp8_linear.choose_kernel`):
  per-tensor and per-channel scales become one scale per output row (exact: each row keeps
  its part's scale) for `torch._scaled_mm`, block scales stay blocks for the Triton GEMM.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quantization import fp8_format as fmt
from pagedserve.quantization.base import LinearMethod, QuantizationConfig
from pagedserve.quantization.fp8_format import Fp8Scheme
from pagedserve.quantization.unquantized import FP8_DTYPES, load_float

logger = logging.getLogger(__name__)

# What the layer holds after loading (`layer.fp8_kernel`).
DEQUANTIZED = "dequantized"


def _kernels_on(device: torch.device) -> bool:
    from pagedserve.quantization.fp8_linear import kernels_on

    return kernels_on(device)


class Fp8LinearMethod(LinearMethod):
    """One layer's FP8 weights under `scheme`; `dequantize`: always into the model dtype."""

    def __init__(self, scheme: Fp8Scheme, dequantize: bool = False) -> None:
        self.scheme = scheme
        self.dequantize = dequantize
        self.name = scheme.describe()

    def create_weights(self, layer: nn.Linear, dtype: torch.dtype) -> None:
        layer.model_dtype = dtype
        layer.fp8_parts = {}  # (start, size) rows -> {scale name: this rank's scale}
        if self.scheme.online:
            return  # a float weight loads as usual and is quantized afterwards
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=fmt.FP8, device=layer.weight.device),
                                    requires_grad=False)

    def checkpoint_tensors(self, layer: nn.Linear) -> tuple[str, ...]:
        bias = ("bias",) if layer.bias is not None else ()
        return ("weight", *self.scheme.checkpoint_scales(), *bias)

    def load(self, layer: nn.Linear, name: str, tensor: Any, shard: str | None,
             rows: tuple[int, int] | None) -> None:
        what = f"{getattr(layer, 'prefix', 'layer')}{'.' + shard if shard else ''}.{name}"
        if name == "bias" or (name == "weight" and self.scheme.online):
            load_float(layer, name, tensor, shard, rows)
            return
        rows = rows or (0, layer.out_features)
        if name == "weight":
            part = layer.rank_part(tensor, "weight", shard)
            if part.dtype not in FP8_DTYPES:
                raise ValueError(f"{what} is {part.dtype}, but the quantization config says "
                                 f"{self.scheme.describe()}: a mislabeled checkpoint?")
            if part.dtype != fmt.FP8:
                raise ValueError(f"{what} is {part.dtype}; only float8_e4m3fn is supported")
            dst = layer.weight.data.narrow(0, *rows)
            if dst.shape != part.shape:
                raise ValueError(f"{what} has shape {tuple(part.shape)}, the model expects "
                                 f"{tuple(dst.shape)}")
            dst.copy_(part)
            return
        if name not in self.scheme.checkpoint_scales():
            raise ValueError(f"checkpoint tensor {what} is not part of {self.scheme.describe()} "
                             f"(expected {', '.join(self.checkpoint_tensors(layer))})")
        if name == "input_scale":
            scale = _scalar(tensor, what)
        else:
            scale = fmt.scale_rank_part(self.scheme, tensor, layer.rank_slice("weight", shard),
                                        what)
            scale = fmt.check_scale(self.scheme, scale, rows[1], layer.in_features, what)
        layer.fp8_parts.setdefault(rows, {})[name] = scale

    def process_after_loading(self, layer: nn.Linear) -> None:
        parts = sorted(layer.fp8_parts.items())
        del layer.fp8_parts
        if self.scheme.online:
            codes, row_scale = fmt.quantize_per_channel(layer.weight.data)
            if self.dequantize or not _kernels_on(codes.device):
                _set_weight(layer, fmt.dequantize(codes, row_scale, _channel(self.scheme))
                            .to(layer.model_dtype))
                layer.fp8_kernel = DEQUANTIZED
                return
            _set_weight(layer, codes)
            layer.weight_scale = row_scale
            layer.input_scale = None
            _finish_cuda(layer, Fp8Scheme("channel", "dynamic"))
            return
        name = self.scheme.scale_name
        if self.dequantize or not _kernels_on(layer.weight.device) \
                or not _kernel_takes(self.scheme):
            full = torch.empty(layer.weight.shape, dtype=layer.model_dtype,
                               device=layer.weight.device)
            for (start, size), scales in parts:
                w = layer.weight.data.narrow(0, start, size)
                full[start:start + size] = fmt.dequantize(
                    w, scales[name].to(w.device), self.scheme).to(layer.model_dtype)
            _set_weight(layer, full)
            layer.fp8_kernel = DEQUANTIZED
            return
        _cuda_layout(layer, self.scheme, parts)

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        if layer.fp8_kernel == DEQUANTIZED:
            return F.linear(x, layer.weight, bias)
        from pagedserve.quantization.fp8_linear import apply_fp8

        return apply_fp8(layer, x, bias)

    def input_group(self, layer: nn.Linear) -> int | None:
        from pagedserve.quantization.fp8_linear import input_group

        return input_group(layer)

    def quantizes_activations(self, layer: nn.Linear) -> bool:
        return layer.fp8_kernel != DEQUANTIZED


def _kernel_takes(scheme: Fp8Scheme) -> bool:
    from pagedserve.quantization.fp8_linear import kernel_takes

    return kernel_takes(scheme)


def _scalar(tensor: Any, what: str) -> torch.Tensor:
    from pagedserve.models.parallel import materialize

    t = materialize(tensor)
    if t.numel() != 1:
        raise ValueError(f"{what} has shape {tuple(t.shape)}; a static input scale is one "
                         "number per tensor")
    return t.reshape(()).float()


def _channel(scheme: Fp8Scheme) -> Fp8Scheme:
    return Fp8Scheme("channel", scheme.activation)


def _set_weight(layer: nn.Linear, weight: torch.Tensor) -> None:
    layer.weight = nn.Parameter(weight, requires_grad=False)


def _cuda_layout(layer: nn.Linear, scheme: Fp8Scheme,
                 parts: list[tuple[tuple[int, int], dict[str, torch.Tensor]]]) -> None:
    """FP8 codes stay; the parts' scales become the layout the kernel reads."""
    device = layer.weight.device
    name = scheme.scale_name
    inputs = [s["input_scale"] for _, s in parts if "input_scale" in s]
    # One static input scale for the fused layer: the parts' largest, so no part's
    # activations clip (the parts share one input).
    layer.input_scale = torch.stack(inputs).max().to(device) if inputs else None
    if scheme.weight in ("tensor", "channel"):
        rows = [s[name].expand(size) if scheme.weight == "tensor" else s[name]
                for (_, size), s in parts]
        layer.weight_scale = torch.cat(rows).to(device).contiguous()
        _finish_cuda(layer, Fp8Scheme("channel", scheme.activation))
        return
    bn = scheme.block[0]
    aligned = all(start % bn == 0 and (size % bn == 0 or start + size == layer.out_features)
                  for (start, size), _ in parts)
    if aligned:
        layer.weight_scale = torch.cat([s[name] for _, s in parts]).to(device).contiguous()
    else:  # parts that share a block row: re-quantize the fused weight in whole blocks
        full = torch.empty(layer.weight.shape, dtype=torch.float32, device=device)
        for (start, size), s in parts:
            full[start:start + size] = fmt.dequantize(
                layer.weight.data[start:start + size], s[name].to(device), scheme)
        codes, layer.weight_scale = fmt.quantize_blocks(full, scheme.block)
        _set_weight(layer, codes)
        logger.info("%s: its fused parts do not align to %d-row blocks; re-quantized whole",
                    getattr(layer, "prefix", "a layer"), bn)
    _finish_cuda(layer, scheme)


def _finish_cuda(layer: nn.Linear, scheme: Fp8Scheme) -> None:
    from pagedserve.quantization.fp8_linear import choose_kernel

    layer.fp8_scheme = scheme
    layer.fp8_kernel = choose_kernel(scheme, layer)


class Fp8Config(QuantizationConfig):
    """`quant_method: fp8` (a checkpoint's), or `--quantization fp8` (online, `scheme.online`)."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignored: list[str] | None = None) -> None:
        super().__init__(ignored)
        self.scheme = scheme

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> Fp8Config:
        fmt_name = data.get("fmt", "e4m3")
        if fmt_name != "e4m3":
            raise ValueError(f"FP8 format {fmt_name!r} is not supported (supported: e4m3)")
        activation = data.get("activation_scheme", "dynamic")
        if activation not in ("dynamic", "static"):
            raise ValueError(f"FP8 activation_scheme {activation!r} is not supported "
                             "(supported: dynamic, static)")
        block = data.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or activation != "dynamic":
                raise ValueError(f"FP8 weight_block_size {block} with {activation} "
                                 "activations is not supported (supported: two sizes, "
                                 "dynamic activations)")
            scheme = Fp8Scheme("block", "dynamic", (int(block[0]), int(block[1])),
                               "weight_scale_inv")
        else:
            scheme = Fp8Scheme("tensor", activation)
        ignored = [*(data.get("ignored_layers") or []),
                   *(data.get("modules_to_not_convert") or [])]
        return cls(scheme, ignored)

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(Fp8Scheme("channel", "dynamic", online=True))

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]
                   ) -> LinearMethod | Any | None:
        # The head stays float in every FP8 format (DeepSeek's config does not list it).
        if prefix == "lm_head" or self.is_ignored(hf_names):
            return None
        if isinstance(layer, nn.Linear):
            # Multi-head latent attention absorbs kv_b_proj into its query and output: it
            # reads the float weight.
            return Fp8LinearMethod(self.scheme, dequantize=prefix.endswith("kv_b_proj"))
        from pagedserve.models.moe import FusedMoE

        if isinstance(layer, FusedMoE):
            from pagedserve.quantization.fp8_moe import Fp8MoEMethod

            return Fp8MoEMethod(self.scheme)
        return None

    def check_model(self, model: nn.Module) -> None:
        if not getattr(model, "supports_quantized_checkpoints", False):
            raise ValueError(f"FP8 weights are not supported for {type(model).__name__} yet")
