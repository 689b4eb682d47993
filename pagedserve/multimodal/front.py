"""What the front does with a prompt's images before the engine sees them: checks them
against the model and the engine's limits, and runs the model's processor (placeholders
expanded, pixels preprocessed, each image's identifier). `process_prompt` is a pure function
of its arguments, so a server may run it on a worker pool off its event loop."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pagedserve.multimodal.encoder_cache import check_encoder_budget, encoder_budgets
from pagedserve.multimodal.inputs import MultiModalPrompt
from pagedserve.multimodal.limits import MODALITIES
from pagedserve.multimodal.processing import MultiModalProcessor, ProcessorSettings


def make_processor(model: str | None, tokenizer: Any,
                   processor_kwargs: Mapping[str, Any] | None = None
                   ) -> MultiModalProcessor | None:
    """The processor of the model at `model` (a Hugging Face directory) when its class takes
    images, with the engine's `mm_processor_kwargs`; None for text-only models (and GGUF
    files or random weights), which refuse `processor_kwargs` by name."""
    if model is None or model.startswith("random:"):
        return _no_processor(processor_kwargs)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        return _no_processor(processor_kwargs)
    from transformers import AutoConfig

    from pagedserve.models.registry import get_model_cls

    config = AutoConfig.from_pretrained(path)
    try:
        cls = get_model_cls(config)
    except ValueError:
        return _no_processor(processor_kwargs)
    if not getattr(cls, "supports_multimodal", False):
        return _no_processor(processor_kwargs)
    processor = cls.processor_cls(config, tokenizer, str(path), processor_kwargs)
    processor.max_image_tokens = cls.max_tokens_per_image(
        config, ProcessorSettings(str(path), dict(processor_kwargs or {})))
    processor.whole_spans = bool(cls.bidirectional_image_spans)
    return processor


def _no_processor(processor_kwargs: Mapping[str, Any] | None) -> None:
    if processor_kwargs:
        raise ValueError(f"mm_processor_kwargs {sorted(processor_kwargs)} given, but the model "
                         "takes no images")
    return None


def image_items(multi_modal_data: Mapping[str, Any] | None) -> list[Any]:
    """The images of vLLM's `multi_modal_data` ({"image": item or [item, ...]}), in order; an
    unknown modality is refused by name."""
    if not multi_modal_data:
        return []
    if not isinstance(multi_modal_data, Mapping):
        raise ValueError(f"multi_modal_data must be a dict such as {{'image': [...]}}, got "
                         f"{type(multi_modal_data).__name__}")
    unknown = [k for k in multi_modal_data if k not in MODALITIES]
    if unknown:
        raise ValueError(f"multi_modal_data modality {unknown[0]!r} is not supported "
                         f"(supported: {', '.join(MODALITIES)})")
    items = multi_modal_data.get("image")
    if items is None:
        return []
    return list(items) if isinstance(items, list | tuple) else [items]


def check_image(item: Any, index: int) -> Any:
    """A PIL image, precomputed embeddings (a 2-D float tensor), or vLLM's dict form of them
    {"image_embeds": [n, hidden], "image_grid_thw": (t, h, w)} (the Qwen-VL family, whose
    grid places the tokens). Returns the item as processors take it: the dict without a grid
    becomes its tensor, the grid an int64 tensor [3]."""
    from PIL import Image

    if isinstance(item, Image.Image):
        return item
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - {"image_embeds", "image_grid_thw"})
        if unknown or "image_embeds" not in item:
            raise ValueError(f"image {index}: an embeddings dict takes image_embeds and "
                             f"image_grid_thw, got keys {sorted(item)}")
        embeds = check_image(item["image_embeds"], index)
        if not isinstance(embeds, torch.Tensor):
            raise ValueError(f"image {index}: image_embeds must be a tensor, got "
                             f"{type(embeds).__name__}")
        if "image_grid_thw" not in item:
            return embeds
        return {"image_embeds": embeds, "image_grid_thw": _grid(item["image_grid_thw"], index)}
    if isinstance(item, torch.Tensor):
        if item.ndim != 2 or not item.is_floating_point():
            raise ValueError(f"image {index}: embeddings must be a 2-D float tensor "
                             f"[tokens, hidden], got {tuple(item.shape)} {item.dtype}")
        return item
    raise ValueError(f"image {index} must be a PIL.Image.Image or a tensor of embeddings, got "
                     f"{type(item).__name__}")


def _grid(grid: Any, index: int) -> torch.Tensor:
    """One image's (t, h, w) patch grid as int64 [3] (a [1, 3] tensor or a list taken)."""
    try:
        t = torch.as_tensor(grid)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is not None and t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t is None or t.shape != (3,) or t.is_floating_point() or t.dtype == torch.bool \
            or not bool((t > 0).all()):
        raise ValueError(f"image {index}: image_grid_thw must be one image's (t, h, w) "
                         f"positive integers, got {grid!r:.80}")
    return t.to(torch.int64)


def check_item_limits(features: list[Any], limits: Mapping[str, int] | None) -> None:
    """A prompt processed already (a server's worker pool) within the engine's limits."""
    for modality, limit in (limits or {}).items():
        count = sum(f.modality == modality for f in features)
        if count > limit:
            raise ValueError(f"the prompt has {count} {modality}s, more than the limit of "
                             f"{limit} per prompt (limit_mm_per_prompt)")


def process_prompt(processor: MultiModalProcessor | None, prompt_token_ids: list[int],
                   multi_modal_data: Mapping[str, Any] | None,
                   limits: Mapping[str, int] | None = None,
                   model_name: str = "this model") -> MultiModalPrompt:
    """The prompt with its images processed: placeholders expanded, one MultiModalFeature per
    image. `limits`: most items per modality (the engine's limit_mm_per_prompt). Raises
    ValueError naming the problem: images for a text-only model, too many images, a bad item,
    placeholders that do not match the images."""
    images = image_items(multi_modal_data)
    if not images:
        return MultiModalPrompt(list(prompt_token_ids), [])
    if processor is None:
        raise ValueError(f"{model_name} takes no images: it is a text-only model")
    limit = (limits or {}).get("image")
    if limit is not None and len(images) > limit:
        raise ValueError(f"the prompt has {len(images)} images, more than the limit of {limit} "
                         "per prompt (limit_mm_per_prompt)")
    images = [check_image(item, i) for i, item in enumerate(images)]
    return processor.process(list(prompt_token_ids), images)


class ImageFront:
    """The engine front's part of images: the model's processor, the engine's limits and
    encoder budgets, and what it preprocessed (images, seconds)."""

    def __init__(self, config: Any, tokenizer: Any, model_name: str,
                 generating: bool = True) -> None:
        self.processor = (make_processor(config.model.model, tokenizer,
                                         config.model.mm_processor_kwargs)
                          if generating else None)
        self.model_name = model_name
        self.limits = {"image": config.model.mm_limit("image")}
        processor = self.processor
        self.budgets = encoder_budgets(config.scheduler,
                                       processor.max_image_tokens if processor else 0)
        # A model that computes each span in one step: a span must fit one step's tokens.
        self.span_limit = (config.scheduler.max_num_batched_tokens
                           if processor is not None and processor.whole_spans else None)
        self.num_preprocessed = 0
        self.preprocess_seconds = 0.0

    def prepare(self, token_ids: list[int],
                multi_modal_data: Mapping[str, Any] | MultiModalPrompt | None
                ) -> MultiModalPrompt | None:
        """A prompt's images processed (or a MultiModalPrompt that process_prompt made
        already, e.g. on a server's worker pool) and checked; None: it has none."""
        if multi_modal_data is None:
            return None
        if isinstance(multi_modal_data, MultiModalPrompt):
            mm = multi_modal_data
            if mm.features and self.processor is None:
                raise ValueError(f"{self.model_name} takes no images: it is a text-only model")
            check_item_limits(mm.features, self.limits)
        else:
            t0 = time.perf_counter()
            mm = process_prompt(self.processor, token_ids, multi_modal_data, self.limits,
                                self.model_name)
            self.preprocess_seconds += time.perf_counter() - t0
            self.num_preprocessed += len(mm.features)
        if not mm.features:
            return None
        check_encoder_budget(mm.features, *self.budgets, self.span_limit)
        return mm
