"""Attention: the backend interface, the registry/selector, the model-facing layer, backends."""

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    BuilderConfig,
)
from pagedserve.attention.registry import (
    BackendSelectionError,
    backend_status,
    get_backend_cls,
    register_backend,
    registered_names,
    select_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionLayerConfig",
    "AttentionMetadataBuilder",
    "BackendSelectionError",
    "BuilderConfig",
    "backend_status",
    "get_backend_cls",
    "register_backend",
    "registered_names",
    "select_backend",
]
