"""From a prompt with one placeholder per image to the expanded token ids and the images'
features, with the model's own transformers image processor (its PIL variant: transformers'
default image processors need torchvision, which the engine does not depend on)."""

from __future__ import annotations

from typing import Any

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

    def process(self, prompt_token_ids: list[int], images: list[Any]) -> MultiModalPrompt:
        """Expand each image's placeholder in `prompt_token_ids` (in order) to its tokens.
        `images`: PIL images, or precomputed embeddings (torch tensors [n, hidden]). Raises
        ValueError naming the problem when placeholders and images do not match."""
        raise NotImplementedError
