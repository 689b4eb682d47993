"""What the engine knows of one image in a prompt, and a prompt with its images processed."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class PlaceholderRange:
    """Where an image's tokens lie in the (expanded) prompt token ids."""

    offset: int  # index of its first token
    length: int  # tokens it spans
    # bool [length]: which of those tokens take an encoder row, the others (Gemma 3's
    # start/end-of-image markers inside a span) keep their token embedding. None: all do.
    is_embed: np.ndarray | None = None

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else int(self.is_embed.sum())

    @property
    def end(self) -> int:
        return self.offset + self.length

    @cached_property
    def embed_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) int64 arrays: the prompt positions [start, end) of each run of
        consecutive embedding tokens, in order (the whole range when every token takes a row).
        Gemma 3's pan-and-scan image is one run per crop, framed by text tokens."""
        if self.is_embed is None:
            return np.array([self.offset]), np.array([self.end])
        edges = np.diff(np.concatenate(([0], self.is_embed.astype(np.int8), [0])))
        return np.flatnonzero(edges == 1) + self.offset, np.flatnonzero(edges == -1) + self.offset


@dataclass
class MultiModalFeature:
    """One image of one request."""

    modality: str  # "image"
    # Hex digest of the item's content and the processor settings that shaped it: the key of
    # the encoder cache, and part of the prefix-cache hash of every block the span touches.
    identifier: str
    placeholder: PlaceholderRange
    # The model's processed inputs for this item alone, on the CPU (pixel_values and
    # image_grid_thw for Qwen2.5-VL; image_embeds when the client sent embeddings).
    data: dict[str, torch.Tensor]


@dataclass
class MultiModalPrompt:
    """A processor's result: the expanded prompt and its images in prompt order."""

    prompt_token_ids: list[int]
    features: list[MultiModalFeature]
    # M-RoPE models (Qwen2-VL family): int64 [3, len(prompt_token_ids)] positions of the
    # prompt (temporal, height, width), and the offset decode positions take after it
    # (position of output token i = num_prompt_tokens + i + mrope_delta, on all three rows).
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    extra: dict = field(default_factory=dict)
