"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a vision transformer over 14x14 patches
whose merger turns each 2x2 block of patches into one token of the Qwen2 decoder, which places
its tokens with M-RoPE (three position rows: temporal, height, width).

The vision tower, as transformers' Qwen2_5_VisionTransformerPretrainedModel computes it:
- patch embedding: the checkpoint's Conv3d covers a whole (channels, 2 frames, 14, 14) patch
  at stride = kernel, so it is one linear map of the flattened patch (the processor's rows);
- patches are reordered window by window (`fullatt_block_indexes` layers see the whole image,
  the others a window of `window_size` pixels), in units of 2x2 merge blocks, and the merger's
  output is put back in image order at the end;
- each block: x + proj(attn(RMSNorm(x))), x + SwiGLU(RMSNorm(x)); attention is bidirectional
  varlen attention (multimodal/encoder_attention.py) over the images (full layers) or the
  windows (the others), with a 2D rotary embedding: the first half of each head's rotary
  frequencies turn with the patch's row, the second with its column;
- the merger: RMSNorm, 4 patches concatenated, Linear-GELU-Linear to the decoder's width.

The decoder is Qwen2 (models/llama.py, whose stack takes `inputs_embeds`) with
`MRotaryEmbedding`; `pagedserve.multimodal.mrope` computes the positions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedserve.device import to_device_async
from pagedserve.models.layers import RMSNorm, silu_and_mul
from pagedserve.models.llama import Qwen2ForCausalLM
from pagedserve.models.mrope_rotary import MRotaryEmbedding
from pagedserve.models.parallel import ParallelLMHead, materialize
from pagedserve.multimodal.encoder_attention import EncoderAttention
from pagedserve.multimodal.inputs import MultiModalFeature
from pagedserve.multimodal.model import SupportsMultiModal
from pagedserve.multimodal.processing import ProcessorSettings
from pagedserve.multimodal.qwen_vl_processing import (
    QwenVLProcessor,
    largest_image_data,
    max_image_tokens,
)

_VISION_EPS = 1e-6  # transformers' vision RMSNorms and merger norm


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionSelfAttention(nn.Module):
    """qkv, the 2D rotary embedding on q and k, varlen attention (metadata `md`: images or
    windows), proj."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim, heads = config.hidden_size, config.num_heads
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn = EncoderAttention(heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                md: Any) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate_vision(q, cos_sin), _rotate_vision(k, cos_sin)
        return self.proj(self.attn(q, k, v.contiguous(), md))


def _rotate_vision(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                   ) -> torch.Tensor:
    # In float32 as transformers' apply_rotary_pos_emb_vision, then back.
    cos, sin = cos_sin
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


def vision_rotary(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [patches, 1, head_dim] float32 of the 2D rotary embedding: the first half of
    the frequencies turn by the patch's row, the second by its column, the pair repeated for
    the rotate-half halves."""
    spatial = head_dim // 2
    inv = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float,
                                       device=rows.device) / spatial)
    freqs = (torch.stack([rows, cols], dim=1)[..., None].float() * inv).flatten(1)
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None]
    return freqs.cos(), freqs.sin()


def patch_coordinates(grids: np.ndarray, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, column) in its image, in the processor's order: frame, block row,
    block column, row in block, column in block."""
    rows, cols = [], []
    for t, h, w in grids.tolist():
        br, bc, ir, ic = np.meshgrid(np.arange(h // merge), np.arange(w // merge),
                                     np.arange(merge), np.arange(merge), indexing="ij")
        rows.append(np.tile((br * merge + ir).reshape(-1), t))
        cols.append(np.tile((bc * merge + ic).reshape(-1), t))
    return np.concatenate(rows), np.concatenate(cols)


def tower_metadata(blocks: nn.ModuleList, cu_seqlens: np.ndarray) -> Any:
    """The bound backend's encoder metadata for sequences cut at `cu_seqlens`."""
    binding = blocks[0].attn.attn.binding
    if binding is None:
        raise RuntimeError("the vision tower's attention has no backend bound "
                           "(multimodal.encoder_attention.bind_encoder_attention)")
    return binding.metadata(np.diff(cu_seqlens))


def image_cu_seqlens(grids: np.ndarray) -> np.ndarray:
    """Each frame of each image one sequence (transformers' convention), in patches."""
    lengths = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
    return np.concatenate([[0], np.cumsum(lengths)])


class VisionBlock(nn.Module):
    """x + attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = RMSNorm(dim, _VISION_EPS)
        self.norm2 = RMSNorm(dim, _VISION_EPS)
        self.attn = VisionSelfAttention(config)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = nn.Linear(dim, 2 * config.intermediate_size)
        self.mlp.down_proj = nn.Linear(config.intermediate_size, dim)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                md: Any) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, md)
        gate_up = self.mlp.gate_up_proj(self.norm2(x))
        if self.act == "silu":
            hidden = silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = ACT2FN[self.act](gate) * up
        return x + self.mlp.down_proj(hidden)


class PatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge_size: int) -> None:
        super().__init__()
        self.width = context_dim * merge_size ** 2
        self.ln_q = RMSNorm(context_dim, _VISION_EPS)
        self.mlp = nn.ModuleList([nn.Linear(self.width, self.width), nn.GELU(),
                                  nn.Linear(self.width, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionGeometry:
    """Where one call's patches go, from the images' grids (t, h, w in patches), in numpy:
    each patch's (row, column), the window order of the merge blocks, and the windows' and
    images' cu_seqlens (both in patches)."""

    def __init__(self, grids: np.ndarray, merge: int, window_blocks: int) -> None:
        unit = merge * merge
        order, window_lens = [], []
        offset = 0  # merge blocks before this image
        for t, h, w in grids.tolist():
            hb, wb = h // merge, w // merge
            # Merge blocks by window (frame, window row, window column), then row-major.
            frame, r, c = np.meshgrid(np.arange(t), np.arange(hb), np.arange(wb), indexing="ij")
            frame, r, c = frame.reshape(-1), r.reshape(-1), c.reshape(-1)
            wr, wc = r // window_blocks, c // window_blocks
            order.append(np.lexsort((c, r, wc, wr, frame)) + offset)
            windows = (frame * -(-hb // window_blocks) + wr) * -(-wb // window_blocks) + wc
            window_lens.append(np.bincount(windows)[np.unique(windows)] * unit)
            offset += t * hb * wb
        self.block_order = np.concatenate(order)  # window order -> image order of blocks
        self.rows, self.cols = patch_coordinates(grids, merge)
        self.window_cu = np.concatenate([[0], np.cumsum(np.concatenate(window_lens))])
        self.image_cu = image_cu_seqlens(grids)
        self.unit = unit

    def patch_order(self) -> np.ndarray:
        """The window order of the patches (each merge block's patches stay together)."""
        return (self.block_order[:, None] * self.unit + np.arange(self.unit)).reshape(-1)


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.window_blocks = config.window_size // self.merge // config.patch_size
        self.fullatt = set(config.fullatt_block_indexes)
        dim = config.hidden_size
        patch = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch, dim, bias=False)  # the Conv3d, flattened
        self.head_dim = dim // config.num_heads
        self.rope_theta = (config.rope_parameters or {}).get("rope_theta", 10000.0)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, dim, self.merge)

    def forward(self, pixel_values: torch.Tensor, grids: np.ndarray) -> torch.Tensor:
        """pixel_values [patches, C*2*14*14] of the images in `grids` order -> [patches / 4,
        out_hidden_size] in the same order."""
        geo = VisionGeometry(grids, self.merge, self.window_blocks)
        device = pixel_values.device
        order = to_device_async(torch.from_numpy(geo.patch_order()), device)
        x = self.patch_embed.proj(pixel_values.to(self.patch_embed.proj.weight.dtype))[order]
        cos_sin = self._rotary(geo, order, device)
        # The backend's metadata for the packing a block attends in, built again where the
        # packing changes: a backend may keep one plan per builder (FlashInfer's ragged
        # prefill wrapper), which the next build replaces.
        md, packing = None, None
        for i, block in enumerate(self.blocks):
            want = geo.image_cu if i in self.fullatt else geo.window_cu
            if want is not packing:
                md, packing = tower_metadata(self.blocks, want), want
            x = block(x, cos_sin, md)
        merged = self.merger(x)
        restore = to_device_async(torch.from_numpy(np.argsort(geo.block_order)), device)
        return merged[restore]

    def _rotary(self, geo: VisionGeometry, order: torch.Tensor, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The 2D rotary embedding's cos, sin in window order."""
        rows, cols = (to_device_async(torch.from_numpy(a), device)[order]
                      for a in (geo.rows, geo.cols))
        return vision_rotary(rows, cols, self.head_dim, self.rope_theta)


class QwenVisionHooks(SupportsMultiModal):
    """What Qwen2.5-VL and Qwen3-VL share: the multimodal hooks (images through `self.visual`,
    a tower taking packed pixels and their grids, merged rows split per image) and the
    checkpoint's names mapped onto the decoder's loader."""

    uses_mrope = True
    processor_cls = QwenVLProcessor

    def checkpoint_config(self) -> PretrainedConfig:
        return self.hf_config  # `config` is the decoder's text_config

    @classmethod
    def max_tokens_per_image(cls, hf_config: PretrainedConfig,
                             settings: ProcessorSettings | None = None) -> int:
        return max_image_tokens(hf_config)

    def dummy_image_data(self) -> dict[str, torch.Tensor]:
        return largest_image_data(self.hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' layout: `model.language_model.*`, `model.visual.*`, `lm_head.*`
        (and transformers 4.x's `model.*` / `visual.*`), through the decoder's loader."""
        patch = self.visual.patch_embed.proj.weight

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = our_name(name)
                if name == "visual.patch_embed.proj.weight":
                    tensor = materialize(tensor).reshape(patch.shape[0], -1)  # Conv3d as linear
                yield name, tensor

        super().load_weights(renamed())

    def embed_multimodal(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """All the features' images through the tower in one call, split per image;
        precomputed embeddings as given."""
        weight = self.model.embed_tokens.weight
        out = [to_device_async(f.data["image_embeds"], weight.device).to(weight.dtype)
               if "image_embeds" in f.data else None for f in features]
        pixel = [i for i, f in enumerate(features) if "pixel_values" in f.data]
        if not pixel:
            return out  # type: ignore[return-value]
        device = self.visual.patch_embed.proj.weight.device
        pixels = to_device_async(torch.cat([features[i].data["pixel_values"] for i in pixel]),
                                 device)
        grids = np.concatenate([features[i].data["image_grid_thw"].reshape(-1, 3).numpy()
                                for i in pixel])
        rows = self.visual(pixels, grids).to(weight.dtype)
        for i, r in zip(pixel, rows.split((grids.prod(axis=1) // self.visual.merge ** 2)
                                          .tolist()), strict=True):
            out[i] = r
        return out  # type: ignore[return-value]


class Qwen2_5_VLForConditionalGeneration(QwenVisionHooks, Qwen2ForCausalLM):
    """The vision tower beside the Qwen2 decoder. `config` is the checkpoint's whole
    config; the decoder's layers are built from its text_config."""

    supports_int8 = False
    supports_quantized_checkpoints = False

    def __init__(self, config: PretrainedConfig) -> None:
        text = config.text_config
        check_decoder_config(text)
        super().__init__(text)
        self.hf_config = config
        tie_head(self, config)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.model.rotary_emb = MRotaryEmbedding(text, head_dim)
        self.visual = Qwen2_5_VisionTransformer(config.vision_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """positions: int64 [3, T] (M-RoPE rows), or [T] meaning all three rows equal."""
        return self.model(input_ids, positions, inputs_embeds)


def tie_head(model: nn.Module, config: PretrainedConfig) -> None:
    """The head tied to the embedding as the whole config says (a flat 4.x-style config puts
    tie_word_embeddings at its top only, e.g. Qwen2.5-VL-3B's)."""
    tie = getattr(config, "tie_word_embeddings", None)
    if tie is None or bool(tie) == model.tie_word_embeddings:
        return
    model.tie_word_embeddings = bool(tie)
    text = config.text_config
    model.lm_head = None if tie else ParallelLMHead(text.hidden_size, text.vocab_size)


def our_name(name: str) -> str:
    """transformers 5's names onto ours; 4.x's (`model.*`, `visual.*`) are ours already."""
    for prefix, ours in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


def check_decoder_config(text: PretrainedConfig) -> None:
    """Refuse by name what the decoder here does not run."""
    if getattr(text, "use_sliding_window", False):
        raise ValueError("Qwen2.5-VL with use_sliding_window is not supported")

