"""What LLaVA and Gemma 3 share as vision-language models whose every image is one square of
the tower's size, encoded to a fixed number of rows by a ViT tower and a projector beside a
decoder: the expansion of each image's placeholder, the split of a call's images into a pixel
batch and precomputed embeddings, the stand-in image of the memory profile, the loading of the
tower's and projector's tensors one to one beside the decoder's own loader, and the decoder's
head, layers and names (`DecoderAtLanguageModel`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pagedserve.device import to_device_async
from pagedserve.models.parallel import materialize
from pagedserve.multimodal.inputs import MultiModalFeature, MultiModalPrompt, PlaceholderRange
from pagedserve.multimodal.processing import tensors_identifier

# Checkpoint prefix -> ours (longest first: the 4.52+ names contain the older ones).
_PREFIXES = (("model.language_model.", "language_model.model."),
             ("language_model.model.", "language_model.model."),
             ("language_model.lm_head.", "language_model.lm_head."),
             ("lm_head.", "language_model.lm_head."),
             ("model.vision_tower.", "vision_tower."),
             ("vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."),
             ("multi_modal_projector.", "multi_modal_projector."))


def expand_images(prompt_token_ids: list[int], images: list[Any],
                  image_data: Callable[[list[Any]], list[dict[str, torch.Tensor]]], *,
                  marker: int, marker_text: str, image_token: int, rows: int, hidden: int,
                  tag: str, before: tuple[int, ...] = (), after: tuple[int, ...] = (),
                  several: Callable[[int], list[int]] | None = None) -> MultiModalPrompt:
    """Each `marker` token of the prompt, in order, becomes `before`, the image's span of
    `image_token`s and `after`: `rows` tokens, or one per row of precomputed embeddings
    (which must be `hidden` wide). An image the processor made into n > 1 squares
    (pixel_values [n, C, H, W]: Gemma 3's original and its pan-and-scan crops) becomes
    `several(n)`'s tokens instead, its span running from the first `image_token` to the
    last, with the text between marked as not taking rows. `image_data` makes the images'
    inputs (`image_inputs`), once the markers are known to match them; `tag` goes into each
    identifier (the family and its settings)."""
    where = np.flatnonzero(np.asarray(prompt_token_ids, dtype=np.int64) == marker)
    if len(where) != len(images):
        raise ValueError(f"the prompt has {len(where)} {marker_text} placeholders but "
                         f"{len(images)} image(s) were given: put one {marker_text} where "
                         "each image goes")
    datas = image_data(images)
    out: list[int] = []
    features: list[MultiModalFeature] = []
    start = 0
    for i, (pos, data) in enumerate(zip(where.tolist(), datas, strict=True)):
        span = rows
        if "image_embeds" in data:
            span, width = data["image_embeds"].shape
            if width != hidden or span < 1:
                raise ValueError(f"image {i}: embeddings of width {width} and {span} rows; the "
                                 f"model takes [rows >= 1, {hidden}]")
        out += prompt_token_ids[start:pos]
        squares = squares_of(data)
        if squares > 1 and several is not None:
            tokens = np.asarray(several(squares), dtype=np.int64)
            embed = tokens == image_token
            first, last = (int(j) for j in np.flatnonzero(embed)[[0, -1]])
            placeholder = PlaceholderRange(len(out) + first, last + 1 - first,
                                           embed[first:last + 1].copy())
            out += tokens.tolist()
        else:
            out += before
            placeholder = PlaceholderRange(len(out), span)
            out += [image_token] * span
            out += after
        start = pos + 1
        features.append(MultiModalFeature("image", tensors_identifier(data, tag), placeholder,
                                          data))
    out += prompt_token_ids[start:]
    return MultiModalPrompt(out, features)


def squares_of(data: dict[str, torch.Tensor]) -> int:
    """How many squares of the tower's size an image's inputs hold (0: embeddings)."""
    pixels = data.get("pixel_values")
    if pixels is None:
        return 0
    return 1 if pixels.dim() == 3 else int(pixels.shape[0])


def image_inputs(images: list[Any],
                 preprocess: Callable[[list[Any]], torch.Tensor | list[torch.Tensor]]
                 ) -> list[dict[str, torch.Tensor]]:
    """Each image's processed inputs: {"pixel_values": [C, H, W]} for a PIL image (all of them
    through one `preprocess` call, which returns [n, C, H, W], or per image [C, H, W] or
    [squares, C, H, W] where an image became several squares), {"image_embeds": [rows,
    hidden]} for a tensor of precomputed embeddings."""
    for i, im in enumerate(images):
        if isinstance(im, dict):  # check_image made a grid-less dict its tensor
            raise ValueError(f"image {i}: this model places an image's embeddings without a "
                             "grid: send image_embeds alone, without image_grid_thw")
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
    stacked through `encode` ([n, C, H, W] -> [n, rows, hidden]) in one call (an image of
    several squares gives their rows one after another), precomputed embeddings as given.
    Host tensors go over pinned (a pageable copy would wait for the step in flight)."""
    out: list[torch.Tensor | None] = [None] * len(features)
    pixels = [i for i, f in enumerate(features) if "pixel_values" in f.data]
    if pixels:
        squares = [features[i].data["pixel_values"].reshape(
            -1, *features[i].data["pixel_values"].shape[-3:]) for i in pixels]
        rows = encode(to_device_async(torch.cat(squares), weight.device))
        for i, part in zip(pixels, rows.split([len(sq) for sq in squares]), strict=True):
            out[i] = part.reshape(-1, part.shape[-1])
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
        param.data.copy_(materialize(tensor))  # the tower is whole on every rank
        loaded.add(ours)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    model.language_model.load_weights(decoder)


class DecoderAtLanguageModel:
    """What LLaVA and Gemma 3 share as classes holding a decoder family's whole model at
    `language_model` beside a tower and a projector: the head and attention layers are the
    decoder's, and checkpoint and LoRA adapter names map onto ours. A class names its
    `checkpoint_family` (for errors) and the tower tensors it does not use."""

    language_model: nn.Module
    checkpoint_family: ClassVar[str] = ""
    unused_tower_tensors: ClassVar[tuple[str, ...]] = ()  # after `vision_model.`

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[Any]:
        return self.language_model.attention_layers()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_tower_and_decoder(self, weights, self.checkpoint_name)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """Our parameter's name for a checkpoint tensor, from transformers 4.50's layout
        (`language_model.model.*`, `vision_tower.vision_model.*`), 4.52+'s (`model.*` beside
        `lm_head.*`) or transformers 5's saves (the tower without `vision_model.`); None for
        an unused tower tensor; anything else refused by name."""
        for prefix, ours in _PREFIXES:
            if not name.startswith(prefix):
                continue
            name = ours + name[len(prefix):]
            if ours != "vision_tower.":
                return name
            rest = name[len(ours):].removeprefix("vision_model.")
            if rest.startswith(cls.unused_tower_tensors):
                return None
            return "vision_tower.vision_model." + rest
        raise ValueError(f"checkpoint tensor {name!r} is not part of a {cls.checkpoint_family} "
                         "checkpoint")

    def hf_names(self, prefix: str) -> list[str]:
        """The checkpoint's module names of our module `prefix` (a fused layer's parts), by
        the decoder's own `hf_names`."""
        head = "language_model."
        if not prefix.startswith(head):
            return [prefix]
        return [head + n for n in self.language_model.hf_names(prefix[len(head):])]

    def adapter_module_name(self, name: str) -> str:
        """transformers 5 puts the decoder's layers at `model.language_model.`, 4.x at
        `language_model.model.`, which is where ours are."""
        prefix = "model.language_model."
        if name.startswith(prefix):
            return "language_model.model." + name[len(prefix):]
        return name
