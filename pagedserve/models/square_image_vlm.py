"""What LLaVA and Gemma 3 share as vision-language models whose every image is one square of
the tower's size, encoded to a fixed number of rows by a ViT tower and a projector beside a
decoder: the split of a call's images into a pixel batch and precomputed embeddings, the
stand-in image of the memory profile, and the loading of the tower's and projector's tensors
one to one beside the decoder's own loader."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.device import to_device_async
from pagedserve.multimodal.inputs import MultiModalFeature


def image_inputs(images: list[Any], preprocess: Callable[[list[Any]], torch.Tensor]
                 ) -> list[dict[str, torch.Tensor]]:
    """Each image's processed inputs: {"pixel_values": [C, H, W]} for a PIL image (all of them
    through one `preprocess` call, which returns [n, C, H, W]), {"image_embeds": [rows, hidden]}
    for a tensor of precomputed embeddings."""
    pil = [i for i, im in enumerate(images) if not isinstance(im, torch.Tensor)]
    datas: list[dict[str, torch.Tensor]] = [{} for _ in images]
    if pil:
        pixels = preprocess([images[i] for i in pil])
        for i, p in zip(pil, pixels, strict=True):
            datas[i] = {"pixel_values": p.contiguous()}
    for i, im in enumerate(images):
        if isinstance(im, torch.Tensor):
            datas[i] = {"image_embeds": im.detach().cpu().contiguous()}
    return datas


def embed_images(features: list[MultiModalFeature],
                 encode: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor
                 ) -> list[torch.Tensor]:
    """One [rows, hidden] tensor per feature, in `weight`'s device and dtype: the pixel images
    stacked through `encode` ([n, C, H, W] -> [n, rows, hidden]) in one call, precomputed
    embeddings as given. Host tensors go over pinned (a pageable copy would wait for the step
    in flight)."""
    out: list[torch.Tensor | None] = [None] * len(features)
    pixels = [i for i, f in enumerate(features) if "pixel_values" in f.data]
    if pixels:
        batch = torch.stack([features[i].data["pixel_values"] for i in pixels])
        rows = encode(to_device_async(batch, weight.device))
        for j, i in enumerate(pixels):
            out[i] = rows[j]
    for i, f in enumerate(features):
        if "image_embeds" in f.data:
            out[i] = to_device_async(f.data["image_embeds"], weight.device).to(weight.dtype)
    return out


def square_pixels(vision_config: Any) -> dict[str, torch.Tensor]:
    """The memory profile's stand-in image: zeros of the tower's input size, on the CPU."""
    v = vision_config
    return {"pixel_values": torch.zeros(v.num_channels, v.image_size, v.image_size)}


def load_tower_and_decoder(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                           our_name: Callable[[str], str | None]) -> None:
    """The decoder's tensors (`language_model.*` after `our_name`) through its own loader
    (fused q/k/v and gate/up, coverage check, rope caches); every other parameter copied one
    to one, each of which must be given. `our_name` maps a checkpoint name to ours (None: a
    tensor the model does not use)."""
    decoder: list[tuple[str, torch.Tensor]] = []
    params = {n: p for n, p in model.named_parameters() if not n.startswith("language_model.")}
    loaded: set[str] = set()
    for name, tensor in weights:
        ours = our_name(name)
        if ours is None:
            continue
        if ours.startswith("language_model."):
            decoder.append((ours[len("language_model."):], tensor))
            continue
        if ours not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                             f"{type(model).__name__}")
        param = params[ours]
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        param.data.copy_(tensor)
        loaded.add(ours)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    model.language_model.load_weights(decoder)
