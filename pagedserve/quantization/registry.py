"""Quantization configs by the `quant_method` a checkpoint names, and the `--quantization`
flag's choices. An unknown method is refused with the list of those supported: a quantized
checkpoint never loads as if its codes were weights."""

from __future__ import annotations

from typing import Any

import torch

from pagedserve import envs
from pagedserve.quantization.awq import AwqConfig
from pagedserve.quantization.base import QuantizationConfig
from pagedserve.quantization.compressed_tensors import FORMATS as FP8_FORMATS
from pagedserve.quantization.compressed_tensors import CompressedTensorsConfig
from pagedserve.quantization.compressed_tensors_int8 import CompressedTensorsInt8Config, is_int
from pagedserve.quantization.compressed_tensors_w4a16 import CompressedTensorsW4A16Config
from pagedserve.quantization.fp8 import Fp8Config
from pagedserve.quantization.gguf_blocks import GgufConfig
from pagedserve.quantization.gptq import GptqConfig
from pagedserve.quantization.int8_cpu import Int8Config
from pagedserve.quantization.mxfp4 import Mxfp4Config

CHECKPOINT_METHODS: dict[str, type[QuantizationConfig]] = {
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "awq": AwqConfig,
    "gptq": GptqConfig,
    "mxfp4": Mxfp4Config,
}
# compressed-tensors formats other than its FP8 ones (compressed_tensors.py), by `format`;
# naive-quantized holds FP8 or (its weights' type says) int8.
COMPRESSED_TENSORS_FORMATS: dict[str, type[QuantizationConfig]] = {
    "pack-quantized": CompressedTensorsW4A16Config,
    "int-quantized": CompressedTensorsInt8Config,
}

# --quantization: auto picks int8 for a GGUF on the CPU when the dtype is left to the engine
# (and gguf on CUDA with PAGEDSERVE_GGUF_KERNEL=1); fp8 quantizes a float checkpoint at load;
# gguf keeps a .gguf file's blocks for the Triton GEMMs; a quantized checkpoint is read as it
# says.
# The checkpoint formats by vLLM's names too: the flag then only says what the checkpoint's
# quantization_config must be (fp8 keeps its own meaning above).
FORMAT_FLAGS = tuple(name for name in CHECKPOINT_METHODS if name != "fp8")
# vLLM's names for the same formats run by its Marlin kernels: here, the format itself.
KERNEL_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
FLAGS = ("auto", "none", "int8", "fp8", "gguf", *FORMAT_FLAGS, *KERNEL_ALIASES)


def resolve_quantization(method: str | None, model: str | None, dtype: str,
                         device: torch.device) -> str | None:
    """The flag's method to run with: "int8", "fp8", "gguf" or None (the checkpoint's
    own)."""
    method = (method or "auto").lower()
    if method not in FLAGS:
        raise ValueError(f"quantization {method!r} is not one of {', '.join(FLAGS)}")
    method = KERNEL_ALIASES.get(method, method)
    gguf = model is None or model.endswith(".gguf")  # None: the bundled GGUF
    if method == "gguf":
        _check_gguf_kernels(gguf, model, device)
        return "gguf"
    if method == "int8":
        if device.type != "cpu":
            raise ValueError("quantization 'int8' is the CPU's weight-only path; on "
                             f"{device.type} leave it out")
        return "int8"
    if method == "fp8":
        return "fp8"
    if method in FORMAT_FLAGS:
        if gguf or (model or "").startswith("random:"):
            what = "a GGUF file" if gguf else "random weights"
            name = repr(model) if model else "the bundled model"
            raise ValueError(f"--quantization {method} names a quantized checkpoint's format; "
                             f"{name} is {what}: leave it out")
        return method
    if method == "none":
        return None
    if device.type == "cuda" and gguf and envs.PAGEDSERVE_GGUF_KERNEL:
        return "gguf"
    if device.type != "cpu" or dtype != "auto":
        return None
    return "int8" if gguf else None


def _check_gguf_kernels(gguf: bool, model: str | None, device: torch.device) -> None:
    if not gguf:
        raise ValueError(f"quantization 'gguf' keeps a .gguf file's blocks; {model!r} is not "
                         "a .gguf file")
    if device.type != "cuda" and not envs.TRITON_INTERPRET:
        raise ValueError(f"quantization 'gguf' runs Triton kernels, on CUDA (on {device.type} "
                         "only in tests, under TRITON_INTERPRET=1); leave it out")


def checkpoint_config(data: dict[str, Any]) -> QuantizationConfig:
    """The config for a checkpoint's `quantization_config`."""
    method = data.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported "
                         f"(supported: {', '.join(CHECKPOINT_METHODS)})")
    if method == "compressed-tensors":
        fmt = data.get("format")
        if fmt == "naive-quantized" and is_int(data):
            return CompressedTensorsInt8Config.from_config(data)
        if fmt in COMPRESSED_TENSORS_FORMATS:
            return COMPRESSED_TENSORS_FORMATS[fmt].from_config(data)
        if fmt not in FP8_FORMATS:  # named here, where every format the method takes is known
            known = (*FP8_FORMATS, *COMPRESSED_TENSORS_FORMATS)
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: "
                             f"{', '.join(known)})")
    return CHECKPOINT_METHODS[method].from_config(data)


def quantization_config(hf_config: Any, flag: str | None) -> QuantizationConfig | None:
    """What the model runs with: the checkpoint's `quantization_config` when it has one (the
    flag may only agree with it), else the flag's (None: float weights)."""
    data = getattr(hf_config, "quantization_config", None)
    if data is not None and not isinstance(data, dict):
        data = data.to_dict()
    if flag in FORMAT_FLAGS:
        says = (f"its quantization_config says {data.get('quant_method')}" if data
                else "it has no quantization_config")
        if not data or data.get("quant_method") != flag:
            raise ValueError(f"--quantization {flag} names the checkpoint's format, but {says}")
        return checkpoint_config(data)
    if data:
        config = checkpoint_config(data)
        if flag not in (None, "fp8") or (flag == "fp8" and not isinstance(config, Fp8Config)):
            raise ValueError(f"the checkpoint is already quantized ({data.get('quant_method')}); "
                             f"--quantization {flag} cannot apply on top: leave it out")
        return config
    if flag == "int8":
        return Int8Config()
    if flag == "fp8":
        return Fp8Config.online()
    if flag == "gguf":
        return GgufConfig()
    return None
