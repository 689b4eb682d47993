"""Models: the Llama family (Llama, Mistral, Qwen2, SmolLM2), the registry that picks a class
from a Hugging Face config, and the loaders (HF directory, GGUF, the bundled default)."""

from pagedserve.models.loader import LoadedModel, default_model_path, load_model
from pagedserve.models.registry import get_model_cls, register_model, supported_architectures

__all__ = [
    "LoadedModel",
    "default_model_path",
    "get_model_cls",
    "load_model",
    "register_model",
    "supported_architectures",
]
