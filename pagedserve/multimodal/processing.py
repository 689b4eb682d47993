"""From a prompt with one placeholder per image to the expanded token ids and the images'
features, with the model's own transformers image processor (its PIL variant: transformers'
default image processors need torchvision, which the engine does not depend on)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from pagedserve.multimodal.inputs import MultiModalPrompt


class MultiModalProcessor:
    """One per vision-language family (the model class's `processor_cls`). Built once per
    engine from the model's Hugging Face config and its directory (preprocessor_config.json);
    `process` runs on a worker pool, off the event loop and the step loop."""

    def __init__(self, hf_config: Any, tokenizer: Any, model_path: str | None) -> None:
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.model_path = model_path

    # The text a prompt holds for one image (what a chat template renders for an image part,
    # and what `LLM.generate`'s prompts carry): `<|vision_start|><|image_pad|><|vision_end|>`
    # for the Qwen family, `<image>` for LLaVA.
    image_placeholder: str = ""
    # The most embedding rows one image may take (the model class's max_tokens_per_image;
    # 0: unknown), set by front.make_processor.
    max_image_tokens: int = 0
    # Whether the model computes each image span in one step (`bidirectional_image_spans`).
    whole_spans: bool = False

    @property
    def embeds_width(self) -> int:
        """How wide a row of precomputed image embeddings is (what the encoder returns per
        token). Default: the decoder's hidden size."""
        text = getattr(self.hf_config, "text_config", None) or self.hf_config
        return int(text.hidden_size)

    def process(self, prompt_token_ids: list[int], images: list[Any]) -> MultiModalPrompt:
        """Expand each image's placeholder in `prompt_token_ids` (in order) to its tokens.
        `images`: PIL images, precomputed embeddings (torch tensors [n, hidden]) or, for a
        family whose grid places the tokens, {"image_embeds", "image_grid_thw"} dicts. Raises
        ValueError naming the problem when placeholders and images do not match."""
        raise NotImplementedError


def tensors_identifier(data: dict[str, torch.Tensor], *extra: object) -> str:
    """A hex digest of an item's processed tensors (names, dtypes, shapes, bytes) and any
    settings passed in `extra`: equal digests mean equal encoder inputs, so the encoder's rows
    and the K/V of the placeholders they fill may be shared."""
    h = hashlib.sha256()
    for name in sorted(data):
        t = data[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    for item in extra:
        h.update(repr(item).encode())
    return h.hexdigest()
