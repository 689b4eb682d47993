"""The engine's settings that can be wrong, checked before anything loads (the model's load is
the slow part of a start, so a typo should not wait for it)."""

from __future__ import annotations

import logging
from pathlib import Path

from pagedserve.config import EngineConfig
from pagedserve.structured_output import check_backend, guided_decoding_unavailable
from pagedserve.structured_output.manager import resolve_workers

logger = logging.getLogger(__name__)


def check_settings(config: EngineConfig) -> str | None:
    """The settings that can be wrong, checked before anything loads; returns the chat
    template `--chat-template` names (its text), if any."""
    from pagedserve.attention.registry import requested_backend
    from pagedserve.models.loader import model_path

    config.check_device()
    requested_backend(config.attention_backend, config.cache.kv_cache_dtype)
    check_backend(config.guided_decoding_backend)
    resolve_workers(config.guided_decoding_workers, config.torch_device)
    missing = guided_decoding_unavailable(config.guided_decoding_backend)
    if missing is not None:
        logger.warning("guided requests will be refused: %s", missing)
    m = config.model
    if not (m.model or "").startswith("random:"):
        model_path(m.model)
    if m.generation_config not in ("auto", "vllm") and not (
            Path(m.generation_config).expanduser() / "generation_config.json").is_file():
        raise ValueError(f"generation_config {m.generation_config!r}: give 'auto', 'vllm' or a "
                         "directory holding a generation_config.json")
    if m.tokenizer is not None and not Path(m.tokenizer).expanduser().exists():
        raise ValueError(f"tokenizer {m.tokenizer!r} does not exist as a local directory or "
                         ".gguf file")
    if m.chat_template is None:
        return None
    path = Path(m.chat_template).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in m.chat_template or "{%" in m.chat_template:
        return m.chat_template
    raise ValueError(f"chat_template {m.chat_template!r} is neither a file nor a Jinja template")
