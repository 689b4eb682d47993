"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP vision tower, a projector
(average pool to `mm_tokens_per_image` rows, RMSNorm, one matrix) and Gemma 3's text decoder
(models/gemma.py).

An image is resized to the tower's square by Gemma 3's image processor (transformers' PIL
variant: no torchvision), cut into patches and run through the tower (bidirectional within the
image, through the attention backend's encoder path: multimodal/encoder_attention.py); the
projector pools the patch grid to `mm_tokens_per_image` rows. The prompt side (the
`<start_of_image>` expansion, pan-and-scan crops) is models/gemma3_processing.py: an image
with crops is several squares through the tower in the same batch, its rows one square after
another.

Inside the decoder the soft tokens of one square attend to each other both ways, every other
token causally, and sliding-window layers keep their window (transformers' Gemma 3 mask:
(causal or same image) and window). The model declares `bidirectional_image_spans`: its
decoder layers run only on attention backends that honour the step's per-token attend limit
(attention/metadata.py), and the scheduler never splits a span across steps.

Weights load from transformers' `save_pretrained` layouts: `language_model.model.*`,
`vision_tower.vision_model.*` (published checkpoints, 4.50; transformers 5 saves the tower
without its `vision_model.` level) and `multi_modal_projector.*`, or `model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*` and `lm_head.*` (4.52 and later). The
SigLIP pooling head some towers carry is not used by Gemma 3 and is skipped.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.gemma import Gemma3ForCausalLM
from pagedserve.models.gemma3_processing import Gemma3Processor, check_config, pan_and_scan_of
from pagedserve.models.layers import GemmaRMSNorm
from pagedserve.models.square_image_vlm import (
    DecoderAtLanguageModel,
    embed_images,
    square_pixels,
)
from pagedserve.models.vit_layers import ViTEncoder
from pagedserve.multimodal.inputs import MultiModalFeature
from pagedserve.multimodal.model import SupportsMultiModal
from pagedserve.multimodal.processing import ProcessorSettings

# ---- the vision tower ------------------------------------------------------------------------

class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, p = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, h, p, stride=p)
        self.position_embedding = nn.Embedding((config.image_size // p) ** 2, h)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, patches, hidden]."""
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"an image of {x.shape[1]} patches; the tower was trained on "
                             f"{self.position_embedding.num_embeddings}")
        return x + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = ViTEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> the last hidden states [N, patches, hidden], post-normed. The
        images are packed into one varlen sequence batch: image i is its own sequence."""
        x = self.embeddings(pixel_values)
        n, length, h = x.shape
        md = self.encoder.layers[0].self_attn.attn.binding.metadata(
            np.full(n, length, dtype=np.int32))
        x = x.reshape(n * length, h)
        for layer in self.encoder.layers:
            x = layer(x, md)
        return self.post_layernorm(x).view(n, length, h)


class SiglipVisionModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(config)


class Gemma3MultiModalProjector(nn.Module):
    """The patch grid average-pooled to mm_tokens_per_image rows, RMSNorm'd (Gemma's, weight
    + 1) and projected to the decoder's width by one matrix [vision hidden, text hidden]."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.text_config.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        self.kernel = self.patches_per_side // int(round(config.mm_tokens_per_image ** 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, patches, vision hidden] -> [N, mm_tokens_per_image, text hidden]."""
        n, _, h = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(n, h, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


# ---- the model -------------------------------------------------------------------------------

class Gemma3ForConditionalGeneration(DecoderAtLanguageModel, SupportsMultiModal, nn.Module):
    checkpoint_family = "Gemma 3"
    unused_tower_tensors = ("head.",)  # SigLIP's pooling head
    processor_cls = Gemma3Processor
    bidirectional_image_spans = True
    # Gemma 3's decoder splits under tensor parallelism; the tower runs whole on every rank.
    splits_decoder = True
    supports_int8 = False
    supports_quantized_checkpoints = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        text = config.text_config
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings",
                                                text.tie_word_embeddings))
        self.vision_tower = SiglipVisionModel(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.language_model = Gemma3ForCausalLM(text)
        for attn in self.language_model.attention_layers():
            attn.bidirectional_spans = True
        # transformers embeds an image token past the vocabulary as id 0 (its rows are replaced
        # by the image's anyway).
        self.image_token_id = int(config.image_token_index)
        self.vocab_size = int(text.vocab_size)

    @classmethod
    def max_tokens_per_image(cls, hf_config: PretrainedConfig,
                             settings: ProcessorSettings | None = None) -> int:
        """One square's rows, times 1 + the most crops under pan-and-scan."""
        return int(hf_config.mm_tokens_per_image) * _most_squares(settings)

    # ---- what the runner calls ---------------------------------------------------------------

    def embed_multimodal(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        return embed_images(
            features, lambda pixels: self.multi_modal_projector(
                self.vision_tower.vision_model(pixels)),
            self.multi_modal_projector.mm_input_projection_weight)

    def dummy_image_data(self) -> dict[str, torch.Tensor]:
        return square_pixels(self.config.vision_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.image_token_id >= self.vocab_size:
            input_ids = torch.where(input_ids == self.image_token_id, 0, input_ids)
        return self.language_model.model.embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.language_model.model(input_ids, positions, inputs_embeds)


def _most_squares(settings: ProcessorSettings | None) -> int:
    """The most squares one image becomes: the original and, under pan-and-scan, its crops."""
    pan_and_scan = pan_and_scan_of(settings)
    return 1 if pan_and_scan is None else 1 + pan_and_scan.max_num_crops
