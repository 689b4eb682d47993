"""The Qwen2-VL family's processor: `<|vision_start|><|image_pad|><|vision_end|>` per image,
the `<|image_pad|>` expanded to the image's merged-token count, and the prompt's M-RoPE
positions.

Images are resized and cut into patches by transformers' `Qwen2VLImageProcessorPil` (the PIL
variant: the default one needs torchvision, which the engine does not depend on), read from
the model directory's preprocessor_config.json (its min/max pixels), or with transformers'
defaults where there is none. An image of grid (t, h, w) patches becomes t*h*w rows of
pixel_values and t*h*w / merge_size**2 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve.multimodal.inputs import MultiModalFeature, MultiModalPrompt, PlaceholderRange
from pagedserve.multimodal.mrope import prompt_positions
from pagedserve.multimodal.processing import MultiModalProcessor, tensors_identifier


def image_processor(model_path: str | None, vision_config: Any) -> Any:
    """The PIL image processor of the model directory (or transformers' defaults), checked
    against the vision tower's patch and merge sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if model_path is not None and (Path(model_path) / "preprocessor_config.json").is_file():
        processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
    else:
        processor = Qwen2VLImageProcessorPil(
            patch_size=vision_config.patch_size, merge_size=vision_config.spatial_merge_size,
            temporal_patch_size=vision_config.temporal_patch_size)
    for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        if getattr(processor, ours) != getattr(vision_config, theirs):
            raise ValueError(f"preprocessor_config.json's {ours} {getattr(processor, ours)} "
                             f"differs from the vision config's {theirs} "
                             f"{getattr(vision_config, theirs)}")
    return processor


def max_image_tokens(hf_config: Any) -> int:
    """The most tokens one image may take: smart_resize keeps an image within max_pixels, so
    within max_pixels / (patch * merge)**2 merged tokens. The image processor is the model
    directory's (the config remembers where it was read from), else transformers' defaults."""
    path = getattr(hf_config, "name_or_path", None) or None
    vision = hf_config.vision_config
    processor = image_processor(path if path and Path(path).is_dir() else None, vision)
    side = vision.patch_size * vision.spatial_merge_size
    return int(processor.size.longest_edge) // (side * side)


def largest_image_data(hf_config: Any) -> dict[str, torch.Tensor]:
    """Processed inputs of one image of the most tokens (zeros), for the memory profile: a
    grid of a x b merged tokens with a * b = max_image_tokens, a the largest divisor not over
    its square root (the near-square grid, whose windows are as full as a real image's)."""
    vision = hf_config.vision_config
    rows = max(max_image_tokens(hf_config), 1)
    a = next(d for d in range(math.isqrt(rows), 0, -1) if rows % d == 0)
    merge = vision.spatial_merge_size
    grid = torch.tensor([1, a * merge, rows // a * merge])
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return {"pixel_values": torch.zeros(int(grid.prod()), width), "image_grid_thw": grid}


class QwenVLProcessor(MultiModalProcessor):
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, hf_config: Any, tokenizer: Any, model_path: str | None,
                 processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(hf_config, tokenizer, model_path, processor_kwargs)
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        self.images = image_processor(model_path, hf_config.vision_config)
        # Part of every image's identifier: the same pixels under other settings differ.
        self._settings = repr(sorted(self.images.to_dict().items()))

    def process(self, prompt_token_ids: list[int], images: list[Any]) -> MultiModalPrompt:
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        pads = np.flatnonzero(ids == self.image_token_id)
        if len(pads) != len(images):
            raise ValueError(f"the prompt has {len(pads)} image placeholders "
                             f"({self.image_placeholder}) for {len(images)} images")
        if not images:
            positions, delta = prompt_positions(len(ids), pads, np.zeros((0, 3)))
            return MultiModalPrompt(list(prompt_token_ids), [], positions, delta)
        datas = self._image_data(images)
        grids = np.stack([d["image_grid_thw"].numpy() for d in datas]).astype(np.int64)
        llm_grids = grids // np.array([1, self.merge, self.merge])
        sizes = llm_grids.prod(axis=1)
        # Each placeholder token repeated to its image's size, the others once.
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[pads] = sizes
        expanded = np.repeat(ids, repeats)
        # Where each image's tokens start now: each image before it added size - 1 tokens.
        offsets = pads + np.cumsum(sizes - 1) - (sizes - 1)
        positions, delta = prompt_positions(len(expanded), offsets, llm_grids)
        features = [MultiModalFeature("image", tensors_identifier(data, self._settings),
                                      PlaceholderRange(int(offset), int(size)), data)
                    for data, offset, size in zip(datas, offsets, sizes, strict=True)]
        return MultiModalPrompt(expanded.tolist(), features, positions, delta)

    @property
    def embeds_width(self) -> int:
        """Qwen3-VL's DeepStack rows ride beside the merger's: (1 + k) * hidden."""
        stacked = getattr(self.hf_config.vision_config, "deepstack_visual_indexes", None) or []
        return (1 + len(stacked)) * int(self.hf_config.text_config.hidden_size)

    def _image_data(self, images: list[Any]) -> list[dict[str, torch.Tensor]]:
        """Each image's encoder inputs, in order: pixel_values and image_grid_thw of the PIL
        images (one processor call), image_embeds and the grid given of embeddings."""
        datas: list[dict[str, torch.Tensor] | None] = [None] * len(images)
        pil = []
        for i, image in enumerate(images):
            if isinstance(image, dict):
                datas[i] = self._embeds_data(image, i)
            elif isinstance(image, torch.Tensor):
                raise ValueError(
                    f"image {i}: Qwen-VL models take precomputed embeddings with their patch "
                    "grid, which places their tokens: {'image_embeds': [tokens, hidden], "
                    "'image_grid_thw': (t, h, w)}")
            else:
                pil.append(i)
        if pil:
            out = self.images(images=[images[i] for i in pil], return_tensors="pt")
            grids = out["image_grid_thw"].reshape(-1, 3)
            pixels = out["pixel_values"].split(grids.prod(dim=1).tolist())
            for i, pix, grid in zip(pil, pixels, grids, strict=True):
                datas[i] = {"pixel_values": pix, "image_grid_thw": grid.clone()}
        return datas  # type: ignore[return-value]

    def _embeds_data(self, item: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
        embeds, grid = item["image_embeds"], item["image_grid_thw"]
        if int(grid[1]) % self.merge or int(grid[2]) % self.merge:
            raise ValueError(f"image {index}: image_grid_thw {grid.tolist()} does not divide "
                             f"into {self.merge}x{self.merge} merged patches")
        rows = int(grid[0]) * int(grid[1]) * int(grid[2]) // self.merge ** 2
        if embeds.shape != (rows, self.embeds_width):
            raise ValueError(f"image {index}: image_embeds is {list(embeds.shape)}; a grid of "
                             f"{grid.tolist()} patches takes [{rows}, {self.embeds_width}]")
        return {"image_embeds": embeds.detach().cpu().contiguous(), "image_grid_thw": grid}
