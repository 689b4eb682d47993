"""Model classes by the architecture name in a Hugging Face config (`config.architectures`).

Entries are import paths, so registering a model (e.g. Mamba, added by its own module) imports
nothing until that architecture is asked for."""

from __future__ import annotations

import importlib

from torch import nn
from transformers import PretrainedConfig

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedserve.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "pagedserve.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pagedserve.models.llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "pagedserve.models.llama:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "pagedserve.models.llama:MixtralForCausalLM",
    "Gemma2ForCausalLM": "pagedserve.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "pagedserve.models.gemma:Gemma3ForCausalLM",
    # Gemma 3 with images (a SigLIP tower; image tokens attend both ways within each image).
    "Gemma3ForConditionalGeneration":
        "pagedserve.models.gemma3_vl:Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM": "pagedserve.models.phi3:Phi3ForCausalLM",
    "Olmo2ForCausalLM": "pagedserve.models.olmo2:Olmo2ForCausalLM",
    "DeepseekV2ForCausalLM": "pagedserve.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "pagedserve.models.deepseek:DeepseekV3ForCausalLM",
    "GptOssForCausalLM": "pagedserve.models.gpt_oss:GptOssForCausalLM",
    "MambaForCausalLM": "pagedserve.models.mamba:MambaForCausalLM",
    "Mamba2ForCausalLM": "pagedserve.models.mamba2:Mamba2ForCausalLM",
    "BambaForCausalLM": "pagedserve.models.bamba:BambaForCausalLM",
    "Qwen3NextForCausalLM": "pagedserve.models.qwen3_next:Qwen3NextForCausalLM",
    "Lfm2ForCausalLM": "pagedserve.models.lfm2:Lfm2ForCausalLM",
    "MiniMaxForCausalLM": "pagedserve.models.minimax:MiniMaxForCausalLM",
    # Vision-language models (images in prompts: pagedserve/multimodal).
    "LlavaForConditionalGeneration": "pagedserve.models.llava:LlavaForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration":
        "pagedserve.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "pagedserve.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    # Encoders (pooling only: encoder-only attention, no KV cache).
    "BertModel": "pagedserve.models.bert:BertModel",
    "BertForSequenceClassification": "pagedserve.models.bert:BertForSequenceClassification",
    "XLMRobertaModel": "pagedserve.models.xlm_roberta:XLMRobertaModel",
    "XLMRobertaForSequenceClassification":
        "pagedserve.models.xlm_roberta:XLMRobertaForSequenceClassification",
    "RobertaModel": "pagedserve.models.xlm_roberta:XLMRobertaModel",
    "RobertaForSequenceClassification":
        "pagedserve.models.xlm_roberta:XLMRobertaForSequenceClassification",
    "ModernBertModel": "pagedserve.models.modernbert:ModernBertModel",
    "ModernBertForSequenceClassification":
        "pagedserve.models.modernbert:ModernBertForSequenceClassification",
}
# Architectures that only pool (no language-model head): `--runner auto` serves them as
# pooling models.
ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "XLMRobertaModel",
                         "XLMRobertaForSequenceClassification", "RobertaModel",
                         "RobertaForSequenceClassification", "ModernBertModel",
                         "ModernBertForSequenceClassification")


# Multimodal checkpoints whose text decoder is served on its own (text in, text out): the text
# model's architecture, and how the checkpoint prefixes its weights -> the text model's prefix
# (transformers 4.50 saved `language_model.model.*`, 4.52 and later `model.language_model.*`
# beside `lm_head.*`); other tensors (vision tower, projector) are skipped. Gemma 3's
# (Gemma3ForConditionalGeneration) now runs whole, images included (models/gemma3_vl.py).
TEXT_DECODERS: dict[str, tuple[str, dict[str, str]]] = {}


def register_model(architecture: str, target: str) -> None:
    """`target` is 'module.path:ClassName'."""
    _MODELS[architecture] = target


def supported_architectures() -> list[str]:
    return list(_MODELS)


def get_model_cls(config: PretrainedConfig) -> type[nn.Module]:
    """The class of the first of `config.architectures` that is registered."""
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            module_name, _, cls_name = _MODELS[arch].partition(":")
            return getattr(importlib.import_module(module_name), cls_name)
    raise ValueError(f"model architecture {architectures or '(none given)'} is not supported; "
                     f"supported: {', '.join(_MODELS)}")
