"""The hooks a model that takes images implements. The runner and the processor call only
these; each is declared here so a new vision-language family is one file and a registry line."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagedserve.multimodal.inputs import MultiModalFeature
from pagedserve.multimodal.processing import ProcessorSettings


class SupportsMultiModal:
    """Mixed into a vision-language model class (beside its decoder family's class)."""

    supports_multimodal: ClassVar[bool] = True
    # Positions are int64 [3, T] (temporal, height, width) instead of [T] (Qwen2-VL family).
    uses_mrope: ClassVar[bool] = False
    # Tokens of one image span attend to each other both ways (Gemma 3): only backends whose
    # `supports_bidirectional_spans` is true run such a model.
    bidirectional_image_spans: ClassVar[bool] = False
    # Its decoder splits under tensor parallelism (the tower runs whole on every rank). A
    # class built on a split decoder family (Qwen-VL) counts without saying so.
    splits_decoder: ClassVar[bool] = False
    # The class that expands placeholders and preprocesses images for this family
    # (processing.MultiModalProcessor subclass).
    processor_cls: ClassVar[Any] = None

    def checkpoint_config(self) -> Any:
        """The checkpoint's whole config (vision and text parts), which `max_tokens_per_image`
        reads. Default: the model's `config`; a model built on a decoder family whose `config`
        is the decoder's (Qwen-VL) returns the whole one."""
        return self.config

    @classmethod
    def max_tokens_per_image(cls, hf_config: Any,
                             settings: ProcessorSettings | None = None) -> int:
        """The most embedding rows one image may take (the encoder cache's default size is at
        least this) under the engine's image settings (None: the config's alone); 0 when it
        has no bound known before requests come."""
        return 0

    def adapter_module_name(self, name: str) -> str:
        """A LoRA adapter's module name (PEFT's, its `base_model.model.` prefix removed) as the
        decoder's own checkpoint names it. Adapters are made on transformers' whole
        vision-language class, which keeps the decoder under `model.language_model.` (4.x
        LLaVA: `language_model.model.`); the decoder's loader names it `model.`. Default:
        those two prefixes mapped, anything else as it is."""
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        return name

    def dummy_image_data(self) -> dict[str, torch.Tensor] | None:
        """The processed inputs of one image of the largest size under the config alone
        (`max_tokens_per_image(config)` rows), on the CPU: what the memory profile runs the
        encoder on, as many as one step's encoder budget holds, before the KV cache is sized.
        (Gemma 3's pan-and-scan crops are more such squares: the budget's worth of squares is
        the peak either way.) None: not profiled."""
        return None

    def embed_multimodal(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """The encoder (vision tower and projector) over several images at once: one
        [placeholder.num_embeds, hidden] tensor per feature, in the model's dtype."""
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's token embeddings of input_ids [T] -> [T, hidden]."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As a decoder's forward; with `inputs_embeds` [T, hidden] the ids are not embedded
        (the runner has written the images' rows over their placeholders' embeddings)."""
        raise NotImplementedError
