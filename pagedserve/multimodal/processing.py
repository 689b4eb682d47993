"""From a prompt with one placeholder per image to the expanded token ids and the images'
features, with the model's own transformers image processor (its PIL variant: transformers'
default image processors need torchvision, which the engine does not depend on)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pagedserve.multimodal.inputs import MultiModalPrompt


@dataclass(frozen=True)
class ProcessorSettings:
    """What shapes a model's images beyond its config.json: its directory (the image
    processor's preprocessor_config.json) and the engine's `mm_processor_kwargs`, which
    override that file's settings as vLLM's do."""

    model_path: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model_config: Any) -> ProcessorSettings:
        """From a ModelConfig (its `model` and `mm_processor_kwargs`)."""
        return cls(model_config.model, dict(model_config.mm_processor_kwargs or {}))


def parse_processor_kwargs(value: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """vLLM's `mm_processor_kwargs`: a dict, or its JSON text (the command line's)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"mm_processor_kwargs is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"mm_processor_kwargs must be a JSON object of settings, e.g. "
                         f'\'{{"do_pan_and_scan": true}}\', got {value!r:.80}')
    return dict(value)


class MultiModalProcessor:
    """One per vision-language family (the model class's `processor_cls`). Built once per
    engine from the model's Hugging Face config, its directory (preprocessor_config.json) and
    the engine's `mm_processor_kwargs`; `process` runs on a worker pool, off the event loop
    and the step loop."""

    # The `mm_processor_kwargs` this family takes (any other is refused by name).
    accepted_kwargs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, hf_config: Any, tokenizer: Any, model_path: str | None,
                 processor_kwargs: Mapping[str, Any] | None = None) -> None:
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.kwargs = dict(processor_kwargs or {})
        check_processor_kwargs(type(self), self.kwargs)

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


def check_processor_kwargs(cls: type[MultiModalProcessor], kwargs: Mapping[str, Any]) -> None:
    """Refuse by name a setting the processor `cls` does not take."""
    unknown = sorted(set(kwargs) - set(cls.accepted_kwargs))
    if unknown:
        known = ", ".join(cls.accepted_kwargs) or "none"
        raise ValueError(f"mm_processor_kwargs {unknown[0]!r} is not a setting of this model's "
                         f"image processing (it takes: {known})")


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
