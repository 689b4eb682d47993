"""`random:<preset or config file>` models: the presets, config files and the random weights
themselves, for throughput measurements at realistic sizes without a checkpoint (no tokenizer,
so prompts are token ids). `loader.load_random_model` builds the model from them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagedserve.distributed.parallel_state import single_rank
from pagedserve.models.checkpoint_loading import hf_parts
from pagedserve.models.registry import get_model_cls

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

# gpt-oss-20b / -120b (as OpenAI's config.json): 24 / 36 layers of 32 / 128 experts of 2,880,
# top-4, clamped SwiGLU, sinks, 128-token sliding windows on every other layer, YaRN x32. Their
# checkpoints are MXFP4 (a config file with base gpt-oss-20b and quantization_config
# {"quant_method": "mxfp4"} draws these very weights packed so: quantization/random_packed.py).
_GPT_OSS = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                head_dim=64, num_experts_per_tok=4, sliding_window=128, swiglu_limit=7.0,
                max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False})
for _name, _layers, _experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
    RANDOM_PRESETS[_name] = dict(
        _GPT_OSS, num_hidden_layers=_layers, num_local_experts=_experts,
        layer_types=["sliding_attention", "full_attention"] * (_layers // 2))

_ARCHITECTURE_OF = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM", "mamba": "MambaForCausalLM",
                    "gpt_oss": "GptOssForCausalLM"}



def _read_fields(path: Path) -> Any:
    """A JSON or YAML file's fields. JSON goes through json: YAML 1.1 reads `1e-05` (no dot)
    as a string, which transformers' configs then refuse."""

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


def random_full_weights(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
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
