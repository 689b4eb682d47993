"""Bare decoder checkpoints: a model saved without its language-model head (`Qwen3Model`,
`LlamaModel`, `Qwen2Model`: what sentence-transformers saves, and how Qwen3-Embedding ships)
is served by its causal family's class, its tensors under `model.`, the head tied to the
embedding (no head is ever run: such a model only pools)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PretrainedConfig

# A bare architecture -> the registered family that runs it.
BASE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


def is_base_model(architectures: list[str] | None) -> bool:
    return any(a in BASE_MODELS for a in architectures or ())


def as_causal_family(config: PretrainedConfig, weights: Iterator[tuple[str, torch.Tensor]]
                     ) -> tuple[PretrainedConfig, Iterator[tuple[str, torch.Tensor]]]:
    """A bare checkpoint's config and tensors as its causal family names them; any other
    checkpoint passes through."""
    architectures = list(getattr(config, "architectures", None) or [])
    arch = next((a for a in architectures if a in BASE_MODELS), None)
    if arch is None:
        return config, weights
    config.architectures = [BASE_MODELS[arch]]
    config.tie_word_embeddings = True
    return config, _under_model(weights)


def _under_model(weights: Iterator[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield (name if name.startswith("model.") else "model." + name), tensor
