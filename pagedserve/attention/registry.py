"""Attention backends by name, and the selector that validates a user's choice.

Backends are registered as import paths so that listing them imports no GPU-only package; a
backend module imports its kernels lazily, inside `is_available()` and its impl.
"""

from __future__ import annotations

import importlib
import logging

import torch

from pagedserve import envs
from pagedserve.attention.backend import AttentionBackend, AttentionLayerConfig
from pagedserve.attention.mla import is_mla

ENV_VAR = "PAGEDSERVE_ATTENTION_BACKEND"

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, str] = {}

# Auto-selection order per device type; the first available backend that supports every layer.
# A quantized kv_cache_dtype (fp8, TurboQuant's presets) goes on to the backends outside the
# order that store it (TURBOQUANT, FLASHINFER on a device whose order lacks it): that setting
# names a cache format, and only they implement it.
AUTO_ORDER = {
    "cuda": ("FLASHINFER", "FLASH_ATTN", "TRITON"),
    "hip": ("ROCM", "TRITON"),
    "cpu": ("CPU",),
}
# Models with multi-head latent attention layers (DeepSeek): their own backends. Per device as
# above: the Triton interpreter is never picked on a CPU unasked. On CUDA FlashInfer's MLA
# kernels come first, as FLASHINFER does for GQA: they are FlashInfer's tuned decode kernels,
# where TRITON_MLA's decode tiles are unmeasured starting points (benchmarks/mla_decode.py
# times both); FLASHINFER_MLA takes fp16/bf16 with latent widths of 128k + 64j only, so float32
# models and other shapes fall through to TRITON_MLA.
AUTO_ORDER_MLA = {"cuda": ("FLASHINFER_MLA", "TRITON_MLA", "CPU_MLA"),
                  "hip": ("TRITON_MLA", "CPU_MLA"), "cpu": ("CPU_MLA",)}


# vLLM's names for the same kernels, accepted as they are.
ALIASES = {"TRITON_ATTN": "TRITON", "TORCH_SDPA": "CPU", "ROCM_ATTN": "ROCM"}


def register_backend(name: str, target: str) -> None:
    """`target` is 'module.path:ClassName'."""
    _REGISTRY[name.upper()] = target


def registered_names() -> list[str]:
    return list(_REGISTRY)


def get_backend_cls(name: str) -> type[AttentionBackend]:
    key = ALIASES.get(name.upper(), name.upper())
    if key not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; registered: "
                         f"{', '.join(_REGISTRY)}")
    module_name, _, cls_name = _REGISTRY[key].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


def backend_status() -> dict[str, tuple[bool, str]]:
    """name -> (available, what runs or why not), for every registered backend."""
    status = {}
    for name in _REGISTRY:
        try:
            status[name] = get_backend_cls(name).is_available()
        except Exception as exc:  # a broken optional install must not hide the others
            status[name] = (False, f"import failed: {exc}")
    return status


def _device_kind(device: torch.device) -> str:
    if device.type == "cuda" and torch.version.hip:
        return "hip"
    return device.type


class BackendSelectionError(ValueError):
    pass


def requested_backend(name: str | None, kv_cache_dtype: str = "auto") -> str | None:
    """The registered name a user asked for (`name`, the flag, else the environment), checked:
    an unknown or unavailable backend is an error listing what is available, and so is one
    that does not store `kv_cache_dtype` (the two settings contradict each other); an unknown
    kv_cache_dtype is an error listing the valid values, asked for or not. Cheap (no model
    needed), so the engine asks it before loading anything. None: nothing was asked for."""
    stores = _backends_storing(kv_cache_dtype)
    requested = name or envs.PAGEDSERVE_ATTENTION_BACKEND
    if not requested:
        return None
    source = "" if name else f" (from ${ENV_VAR})"
    key = ALIASES.get(requested.upper(), requested.upper())
    status = backend_status()
    if key not in status:
        raise BackendSelectionError(
            f"unknown attention backend {requested!r}{source}; valid names: "
            f"{', '.join(status)}\n{_explain(status)}")
    if key not in stores:  # the settings contradict each other, whatever runs here
        raise BackendSelectionError(
            f"attention backend {key}{source} does not store kv_cache_dtype "
            f"{kv_cache_dtype!r}; the backends that do: {', '.join(stores)} (name one of them, "
            f"or leave the attention backend unset to choose one automatically)")
    ok, why = status[key]
    if not ok:
        raise BackendSelectionError(
            f"attention backend {key}{source} is not available: {why}\n{_explain(status)}")
    return key


def _backends_storing(kv_cache_dtype: str) -> list[str]:
    """The registered backends that store `kv_cache_dtype`, available here or not; a value no
    backend stores is an error listing the valid ones."""
    stored = _stored_kv_cache_dtypes()
    stores = [name for name, dtypes in stored.items() if kv_cache_dtype in dtypes]
    if not stores:
        valid = dict.fromkeys(dtype for dtypes in stored.values() for dtype in dtypes)
        raise BackendSelectionError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}: no attention backend stores it; valid "
            f"values: {', '.join(valid)}")
    return stores


def _stored_kv_cache_dtypes() -> dict[str, tuple[str, ...]]:
    """name -> the kv_cache_dtype values the backend stores. A backend whose module fails to
    import is left out (backend_status says why)."""
    stored = {}
    for name in _REGISTRY:
        try:
            stored[name] = get_backend_cls(name).supported_kv_cache_dtypes
        except Exception:  # a broken optional install must not hide the others
            continue
    return stored


def _explain(status: dict[str, tuple[bool, str]]) -> str:
    available = [n for n, (ok, _) in status.items() if ok]
    lines = [f"available here: {', '.join(available) or 'none'}"]
    lines += [f"  {n}: {why}" for n, (ok, why) in status.items() if not ok]
    return "\n".join(lines)


def select_backend(name: str | None, device: torch.device, layers: list[AttentionLayerConfig],
                   block_size: int) -> type[AttentionBackend]:
    """The backend named by `name` (the CLI flag), else by $PAGEDSERVE_ATTENTION_BACKEND, else
    the best available for the device. A named backend that is unknown, unavailable or cannot
    run these layers is an error listing what is available; it is never silently replaced.
    `layers`: the model's attention layers in order; errors name them by position."""
    kv_cache_dtype = _kv_cache_dtype(layers)
    key = requested_backend(name, kv_cache_dtype)
    if key is not None:
        cls = get_backend_cls(key)
        reasons = _layer_problems(cls, layers, block_size, device)
        if reasons:
            source = "" if name else f" (from ${ENV_VAR})"
            raise BackendSelectionError(
                f"attention backend {key}{source} cannot run this model: {'; '.join(reasons)}\n"
                f"{_explain(backend_status())}")
        return cls
    return _automatic_choice(device, layers, block_size, kv_cache_dtype)


def _kv_cache_dtype(layers: list[AttentionLayerConfig]) -> str:
    """The cache setting the layers ask for: the engine gives every layer the one
    --kv-cache-dtype."""
    return layers[0].kv_cache_dtype if layers else "auto"


def _automatic_choice(device: torch.device, layers: list[AttentionLayerConfig], block_size: int,
                      kv_cache_dtype: str) -> type[AttentionBackend]:
    """The first backend of the device's order that is available and runs the layers, then
    (a quantized kv_cache_dtype) the others that store that dtype; a slow reference path only
    when nothing after it can. An error lists why each one tried cannot."""
    status = backend_status()
    order = _auto_order(device, layers)
    stores = _backends_storing(kv_cache_dtype)
    # "auto" is every backend's: the choice is the device's order alone, as it always was.
    others = [] if kv_cache_dtype == "auto" else [k for k in stores if k not in order]
    tried = []
    fallback = None  # the first able backend that runs only a slow reference path here
    for key in [*order, *others]:
        if key not in status:
            continue
        problems = _problems(key, status[key], layers, block_size, device,
                             with_layers=key in others)
        if problems:
            tried.append(f"{key}: {'; '.join(problems)}")
            continue
        cls = get_backend_cls(key)
        if not cls.is_fallback():
            return _chosen(cls, kv_cache_dtype, order, status, stores)
        fallback = fallback or cls
    if fallback is not None:
        return _chosen(fallback, kv_cache_dtype, order, status, stores)
    raise BackendSelectionError(
        f"no attention backend can run this model on {device}"
        f"{_dtype_hint(kv_cache_dtype, stores)}:\n  " + "\n  ".join(tried))


def _auto_order(device: torch.device, layers: list[AttentionLayerConfig]) -> list[str]:
    kind = _device_kind(device)
    if any(is_mla(layer) for layer in layers):
        return list(AUTO_ORDER_MLA.get(kind, ("CPU_MLA",)))
    return list(AUTO_ORDER.get(kind, ()))


def _problems(key: str, available: tuple[bool, str], layers: list[AttentionLayerConfig],
              block_size: int, device: torch.device, with_layers: bool) -> list[str]:
    """Why backend `key` cannot run the layers here; empty when it can. An unavailable
    backend's reason is why it is not available; `with_layers` (a backend tried only because
    it stores the kv_cache_dtype) adds what the layers say, since installing it may not be
    enough on this device (FlashInfer on a CPU)."""
    ok, why = available
    if ok:
        return _layer_problems(get_backend_cls(key), layers, block_size, device)
    if not with_layers:
        return [why]
    try:
        return [why, *_layer_problems(get_backend_cls(key), layers, block_size, device)]
    except Exception:  # its module does not import: `why` says so
        return [why]


def _chosen(cls: type[AttentionBackend], kv_cache_dtype: str, order: list[str],
            status: dict[str, tuple[bool, str]], stores: list[str]) -> type[AttentionBackend]:
    """`cls`, the automatic choice; for a quantized kv_cache_dtype one INFO line says why it
    is this backend (the device's order may name others first)."""
    if kv_cache_dtype == "auto":
        return cls
    name = cls.get_name()
    before = order[:order.index(name)] if name in order else order
    passed = [k for k in before if status.get(k, (False, ""))[0] and k not in stores]
    if passed:
        verb = "does" if len(passed) == 1 else "do"
        why = f"the automatic order's {', '.join(passed)} {verb} not store it"
    elif name in order:
        why = "the first of the automatic order that can run the model"
    else:
        why = "nothing in the automatic order can run the model here"
    logger.info("kv_cache_dtype %r: attention backend %s (%s)", kv_cache_dtype, name, why)
    return cls


def _dtype_hint(kv_cache_dtype: str, stores: list[str]) -> str:
    """What the selection error adds for a quantized cache: the setting and who stores it."""
    if kv_cache_dtype == "auto":
        return ""
    where = "it" if len(stores) == 1 else "one of them"
    return (f" with kv_cache_dtype {kv_cache_dtype!r} (stored by {', '.join(stores)} only: "
            f"run where {where} can, or choose another kv_cache_dtype)")


def _layer_problems(cls: type[AttentionBackend], layers: list[AttentionLayerConfig],
                    block_size: int, device: torch.device) -> list[str]:
    """Why the backend cannot run these layers, each reason once and prefixed by the layers
    (positions in `layers`) it holds for: "layers 1, 3, 5: sliding window not supported"."""
    verdicts: dict[AttentionLayerConfig, list[str]] = {}
    holders: dict[str, list[int]] = {}
    for index, layer in enumerate(layers):
        if layer not in verdicts:  # layers of one configuration share a verdict
            verdicts[layer] = _layer_reasons(cls, layer, block_size, device)
        for reason in verdicts[layer]:
            holders.setdefault(reason, []).append(index)
    return [f"{_name_layers(indices, len(layers))}: {reason}"
            for reason, indices in holders.items()]


def _layer_reasons(cls: type[AttentionBackend], layer: AttentionLayerConfig, block_size: int,
                   device: torch.device) -> list[str]:
    if is_mla(layer) and not cls.supports_mla:
        return ["multi-head latent attention not supported"]
    return cls.validate_configuration(layer, block_size, device)


def _name_layers(indices: list[int], num_layers: int) -> str:
    """'layer 3', 'layers 1, 3, 5', 'layers 0-3, 8' or, for every one of several, 'all 36
    layers' (a model's list would be long and say nothing more)."""
    if len(indices) == 1:
        return f"layer {indices[0]}"
    if len(indices) == num_layers:
        return f"all {num_layers} layers"
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "layers " + ", ".join(_span(run) for run in runs)


def _span(run: list[int]) -> str:
    """Consecutive layers: three or more as a range, fewer listed."""
    if len(run) > 2:
        return f"{run[0]}-{run[-1]}"
    return ", ".join(map(str, run))


_BUILTIN = {
    "FLASHINFER": "flashinfer:FlashInferBackend",
    "FLASH_ATTN": "flash_attn:FlashAttentionBackend",
    "TRITON": "triton_attn:TritonAttentionBackend",
    "CPU": "cpu:CPUAttentionBackend",
    "CPU_MLA": "cpu_mla:CPUMLABackend",
    "TRITON_MLA": "triton_mla:TritonMLABackend",
    "FLASHINFER_MLA": "flashinfer_mla:FlashInferMLABackend",
    "ROCM": "rocm:RocmAttentionBackend",
    "TURBOQUANT": "turboquant:TurboQuantBackend",
    # chosen by name only (eager, unfused on the CPU): never in AUTO_ORDER.
    "FLEX_ATTENTION": "flex_attention:FlexAttentionBackend",
    # State layers' slots; the model runner picks each for its layers by the layer's
    # backend_name (never auto-selected for attention).
    "MAMBA": "mamba:MambaBackend",
    "MAMBA2": "mamba2:Mamba2Backend",  # Mamba-2 mixers (Mamba2, Bamba), likewise
    # Gated delta net layers' state slots (Qwen3-Next), likewise picked by the runner.
    "GDN_ATTN": "gdn:GDNBackend",
    "SHORT_CONV": "short_conv:ShortConvBackend",  # LFM2's short convolutions
    "LINEAR_ATTN": "linear_attn:LinearAttentionBackend",  # MiniMax's lightning attention
}
for _name, _target in _BUILTIN.items():
    register_backend(_name, f"pagedserve.attention.backends.{_target}")
