"""Reading a PEFT adapter directory into per-layer low-rank factors for our (fused) layers.

A PEFT checkpoint names the Hugging Face modules (`q_proj`, `gate_proj`, ...); our model fuses
some of them (`qkv_proj`, `gate_up_proj`). Each of our linear layers gets one `LayerFactors`
holding, per fused part, A [r, in] and B [part rows, r] with the adapter's scaling folded into
B, so the forward adds x A^T B^T to that part's slice of the output.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass
class PartFactors:
    """One fused part's factors: A [r, in], B [rows, r] (scaled), the part's first row."""

    row_start: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    """An adapter's factors by our layer prefix, and its rank (the largest of its layers)."""

    name: str
    rank: int
    layers: dict[str, list[PartFactors]] = field(default_factory=dict)


def read_config(path: Path) -> dict:
    """adapter_config.json, with what we do not implement refused by name."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"LoRA adapter {path}: missing {CONFIG_FILE}")
    try:
        config = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} is not valid JSON "
                         f"({str(exc)[:200]})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} must be a JSON object, got "
                         f"{type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {config['peft_type']!r} is not "
                         f"supported (only LORA)")
    _check_scale_fields(path, config)
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {path}: DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path}: modules_to_save "
                         f"{config['modules_to_save']} is not supported (only low-rank "
                         f"factors, no fully trained modules)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {path}: {key} is not supported yet")
    return config


def _check_scale_fields(path: Path, config: dict) -> None:
    """r and lora_alpha, which the scale divides and multiplies by (a bool is no number)."""
    if "r" not in config:
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} needs r (the rank)")
    r = config["r"]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"LoRA adapter {path}: r must be an integer >= 1, got {r!r}")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) \
            or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {path}: lora_alpha must be a finite number, got "
                         f"{alpha!r}")


def scaling(config: dict) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"LoRA adapter {path}: missing {WEIGHTS_FILE} (only the "
                                f"safetensors format is read)")
    return load_file(str(file))


def hf_module_names(tensors: Iterable[str], path: Path) -> set[str]:
    """The Hugging Face modules the adapter targets (its lora_A keys, PEFT prefix removed);
    `tensors`: the tensors' names (or a dict by them)."""
    names = set()
    for key in tensors:
        module, _, kind = key.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {path}: tensor {key!r} is not a LoRA factor "
                             f"(lora_A/lora_B weights only; biases and embeddings are not "
                             f"supported)")
        names.add(module.removeprefix(_PEFT_PREFIX))
    return names


def check_adapter_dir(path: str | Path, name: str, max_rank: int) -> dict:
    """What can be checked without the model: the directory, both files, the config's
    refusals and the rank. Returns the config."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"LoRA adapter {name!r}: no directory {path}")
    config = read_config(path)
    if not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"LoRA adapter {path}: missing {WEIGHTS_FILE} (only the "
                                f"safetensors format is read)")
    hf_module_names(_tensor_names(path), path)  # embeddings, biases: refused before first use
    rank = int(config["r"])
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, over --max-lora-rank "
                         f"{max_rank}; raise --max-lora-rank")
    return config


def _tensor_names(path: Path) -> list[str]:
    """The weights file's tensor names, from its header alone."""
    from safetensors import safe_open

    try:
        with safe_open(str(path / WEIGHTS_FILE), "pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors' own error type for a damaged header
        raise ValueError(f"LoRA adapter {path}: {WEIGHTS_FILE} is not a readable safetensors "
                         f"file ({exc})") from None


def load_adapter(path: str | Path, name: str, targets: dict[str, Any], max_rank: int,
                 dtype: torch.dtype, rename: Callable[[str], str] | None = None
                 ) -> LoRAAdapter:
    """The adapter at `path` mapped onto `targets` (HF module name -> `layers.LoRATarget`);
    every check names the tensor and the numbers. With tensor parallelism each rank keeps
    its share, as the layer's weight is split: a column-parallel layer's B rows, a
    row-parallel layer's A columns."""
    path = Path(path)
    config = check_adapter_dir(path, name, max_rank)
    scale = scaling(config)
    tensors = read_tensors(path)
    adapter = LoRAAdapter(name, int(config["r"]))
    for hf in sorted(hf_module_names(tensors, path)):
        target = targets.get(rename(hf) if rename is not None else hf)
        if target is None:
            raise ValueError(f"LoRA adapter {name!r}: module {hf!r} is not a linear layer of "
                             f"the base model{_tower_hint(hf)}")
        if target.rows < 0:
            raise ValueError(f"LoRA adapter {name!r}: {hf} is stored fused in the checkpoint; "
                             f"its factors cannot be split over tensor-parallel ranks yet")
        a = tensors[f"{_PEFT_PREFIX}{hf}.lora_A.weight"]
        b = tensors[f"{_PEFT_PREFIX}{hf}.lora_B.weight"]
        _check_shapes(name, hf, a, b, target.in_features, target.rows, max_rank)
        a, b = _rank_share(target, a, b)
        adapter.layers.setdefault(target.prefix, []).append(
            PartFactors(target.row_start, a.to(dtype), (b.float() * scale).to(dtype)))
    return adapter


def _tower_hint(hf: str) -> str:
    tower = ("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.")
    if any(part in f".{hf}" for part in (f".{t}" for t in tower)):
        return "'s language model (adapters of vision towers are not supported)"
    return ""


def _rank_share(target: Any, a: torch.Tensor, b: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A and B: sliced where the layer's weight is (None: whole)."""
    cut = target.layer.rank_slice("weight", target.shard)
    if cut is None:
        return a, b
    dim, start, n = cut
    if dim == 0:  # output rows: B's rows
        return a, b.narrow(0, start, n)
    return a.narrow(1, start, n), b  # input columns: A's columns


def _check_shapes(name: str, hf: str, a: torch.Tensor, b: torch.Tensor, in_features: int,
                  rows: int, max_rank: int) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA adapter {name!r}: {hf} lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)} are not [r, in] and [out, r]")
    if a.shape[1] != in_features or b.shape[0] != rows:
        raise ValueError(f"LoRA adapter {name!r}: {hf} maps {a.shape[1]} -> {b.shape[0]} "
                         f"features but the base model's layer maps {in_features} -> {rows}; "
                         f"the adapter was trained for another base model")
    if a.shape[0] > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: {hf} has rank {a.shape[0]}, over "
                         f"--max-lora-rank {max_rank}")
