"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector and
a Llama-family decoder (models/llama.py).

An image is resized and cropped by CLIP's image processor (transformers' PIL variant: no
torchvision), cut into patches, and run through the tower with a class token; the hidden states
of `vision_feature_layer` (-2: the second to last layer's output), without the class token
under the "default" strategy, go through the projector: one decoder embedding per patch. The
prompt's `<image>` is expanded to that many image tokens, whose embeddings the runner replaces
by the projector's rows (multimodal/runner.py). The tower's attention is bidirectional within
each image, through the attention backend's encoder path (multimodal/encoder_attention.py).

Weights load from transformers' `save_pretrained` layouts: `vision_tower.*`,
`multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*` (published
checkpoints, and transformers 5's saves, whose tower lacks the `vision_model.` level), or
`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`
(transformers 4.52 to 4.5x).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedserve.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pagedserve.models.square_image_vlm import (
    DecoderAtLanguageModel,
    embed_images,
    expand_images,
    image_inputs,
    square_pixels,
)
from pagedserve.models.vit_layers import ViTEncoder
from pagedserve.multimodal.inputs import MultiModalFeature, MultiModalPrompt
from pagedserve.multimodal.model import SupportsMultiModal
from pagedserve.multimodal.processing import MultiModalProcessor, ProcessorSettings

# The decoder families a LLaVA checkpoint may carry, by text_config.model_type.
_DECODERS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}


def feature_layers(config: PretrainedConfig) -> list[int]:
    """The tower's hidden states the projector reads, as indices into (embeddings, layer 1
    output, ..., layer L output)."""
    layers = config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    n = config.vision_config.num_hidden_layers
    return [i if i >= 0 else n + 1 + i for i in layers]


def image_tokens(config: PretrainedConfig) -> int:
    """Decoder tokens of one image: a patch each, and the class token under "full"."""
    v = config.vision_config
    patches = (v.image_size // v.patch_size) ** 2
    return patches + (config.vision_feature_select_strategy == "full")


def check_config(config: PretrainedConfig) -> None:
    strategy = config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                         "(default or full)")
    vision_type = getattr(config.vision_config, "model_type", "")
    if vision_type != "clip_vision_model":
        raise ValueError(f"LLaVA with a {vision_type!r} vision tower is not supported (CLIP "
                         "only)")
    text_type = getattr(config.text_config, "model_type", "")
    if text_type not in _DECODERS:
        raise ValueError(f"LLaVA with a {text_type!r} decoder is not supported (supported: "
                         f"{', '.join(_DECODERS)})")
    n = config.vision_config.num_hidden_layers
    if not all(0 <= i <= n for i in feature_layers(config)):
        raise ValueError(f"vision_feature_layer {config.vision_feature_layer} is out of range "
                         f"for a tower of {n} layers")


# ---- the processor ---------------------------------------------------------------------------

class LlavaProcessor(MultiModalProcessor):
    """`<image>` -> one image token per embedding row; pixels by CLIP's image processor."""

    image_placeholder = "<image>"

    def __init__(self, hf_config: Any, tokenizer: Any, model_path: str | None,
                 processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(hf_config, tokenizer, model_path, processor_kwargs)
        from transformers import CLIPImageProcessorPil

        check_config(hf_config)
        self.image_token_id = int(hf_config.image_token_id)
        self.num_image_tokens = image_tokens(hf_config)
        if model_path is None or not (Path(model_path) / "preprocessor_config.json").is_file():
            raise ValueError(f"{model_path}: a LLaVA checkpoint needs its "
                             "preprocessor_config.json (the CLIP image processor's settings)")
        self.image_processor = CLIPImageProcessorPil.from_pretrained(model_path)
        token = (tokenizer.convert_ids_to_tokens(self.image_token_id) if tokenizer is not None
                 else None)
        if isinstance(token, str):  # the checkpoint's own spelling of its image token
            self.image_placeholder = token

    def process(self, prompt_token_ids: list[int], images: list[Any]) -> MultiModalPrompt:
        return expand_images(
            prompt_token_ids, images, self._image_data, marker=self.image_token_id,
            marker_text=self.image_placeholder, image_token=self.image_token_id,
            rows=self.num_image_tokens, hidden=self.hf_config.text_config.hidden_size,
            tag="llava")

    def _image_data(self, images: list[Any]) -> list[dict[str, torch.Tensor]]:
        return image_inputs(images, self._pixels)

    def _pixels(self, images: list[Any]) -> torch.Tensor:
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        size = self.hf_config.vision_config.image_size
        if tuple(pixels.shape[-2:]) != (size, size):
            raise ValueError(f"the image processor made {tuple(pixels.shape[-2:])} pixel "
                             f"images; the vision tower takes {size}x{size}: the "
                             "checkpoint's preprocessor_config.json does not match it")
        return pixels


# ---- the vision tower ------------------------------------------------------------------------

class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, p = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(h))
        self.patch_embedding = nn.Conv2d(config.num_channels, h, p, stride=p, bias=False)
        num_positions = (config.image_size // p) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, h)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, 1 + patches, hidden]: the class token, then the patches."""
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"an image of {x.shape[1] - 1} patches; the tower was trained on "
                             f"{self.position_embedding.num_embeddings - 1}")
        return x + self.position_embedding.weight


class CLIPVisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = ViTEncoder(config)
        # In the checkpoint; LLaVA reads hidden states before it, so it is never run.
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_states(self, pixel_values: torch.Tensor, wanted: list[int]
                      ) -> list[torch.Tensor]:
        """The hidden states `wanted` (0: the embeddings after pre_layrnorm, i: layer i's
        output), each [N, 1 + patches, hidden]; layers past the last wanted are not run."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        n, length, h = x.shape
        layer0 = self.encoder.layers[0].self_attn.attn
        md = layer0.binding.metadata(np.full(n, length, dtype=np.int32))
        x = x.reshape(n * length, h)  # packed: image i is rows i*length..(i+1)*length-1
        out = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.encoder.layers[:max(wanted)], start=1):
            x = layer(x, md)
            if i in wanted:
                out[i] = x
        return [out[i].view(n, length, h) for i in wanted]


class CLIPVisionModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.vision_model = CLIPVisionTransformer(config)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        width = config.vision_config.hidden_size * len(feature_layers(config))
        hidden = config.text_config.hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(width, hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


# ---- the model -------------------------------------------------------------------------------

class LlavaForConditionalGeneration(DecoderAtLanguageModel, SupportsMultiModal, nn.Module):
    checkpoint_family = "LLaVA"
    processor_cls = LlavaProcessor
    supports_int8 = False
    supports_quantized_checkpoints = False
    # Every decoder it takes (_DECODERS) splits under tensor parallelism.
    splits_decoder = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        text = config.text_config
        if getattr(config, "tie_word_embeddings", False):
            text.tie_word_embeddings = True
        self.vision_tower = CLIPVisionModel(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.language_model = _DECODERS[text.model_type](text)
        self.feature_layers = feature_layers(config)
        self.drop_cls = config.vision_feature_select_strategy == "default"

    @classmethod
    def max_tokens_per_image(cls, hf_config: PretrainedConfig,
                             settings: ProcessorSettings | None = None) -> int:
        return image_tokens(hf_config)

    # ---- what the runner calls ---------------------------------------------------------------

    def embed_multimodal(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        return embed_images(features, self._encode, self.multi_modal_projector.linear_1.weight)

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower.vision_model.hidden_states(pixels, self.feature_layers)
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def dummy_image_data(self) -> dict[str, torch.Tensor]:
        return square_pixels(self.config.vision_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, inputs_embeds)
