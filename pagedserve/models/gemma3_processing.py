"""Gemma 3's prompt side of images: `<start_of_image>` expanded at the token level as
transformers' Gemma3Processor does with text, and the pixels by its image processor (the PIL
variant: no torchvision), pan-and-scan crops included.

Without pan-and-scan an image becomes `\\n\\n <start_of_image> <image_soft_token> x
mm_tokens_per_image <end_of_image> \\n\\n`, the soft tokens its placeholder span. With it
(`do_pan_and_scan` in preprocessor_config.json or the engine's mm_processor_kwargs) an image
wide or tall enough (`pan_and_scan_min_ratio_to_activate`) is also cut into 2 to
`pan_and_scan_max_num_crops` crops along its long side (each at least
`pan_and_scan_min_crop_size` pixels), each resized to the tower's square like the original,
and the image's text becomes transformers' "Here is the original image <seq> and here are some
crops to help you see better <seq> <seq> ...", tokenized whole by the model's tokenizer. One
image is then one feature: its pixels [1 + crops, C, H, W], its placeholder from the first
soft token to the last, the text between marked as keeping its token embeddings
(`PlaceholderRange.is_embed`). The decoder's soft tokens attend both ways within each square
only, as transformers' token_type_ids make them (one group per run of soft tokens).

transformers' Gemma3Processor passes its own defaults (do_pan_and_scan false, crops of at least
256 pixels, at most 4, from a ratio of 1.2) over the image processor's settings, so through it
a preprocessor_config.json's do_pan_and_scan has no effect unless passed again at the call.
Here the file's settings count (as vLLM resolves them), its nulls take those defaults, and the
engine's mm_processor_kwargs override both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from pagedserve.models.square_image_vlm import expand_images, image_inputs
from pagedserve.multimodal.inputs import MultiModalPrompt
from pagedserve.multimodal.processing import MultiModalProcessor, ProcessorSettings

# transformers' Gemma3Processor.images_kwargs: what a null (or absent) setting means.
PAN_AND_SCAN_DEFAULTS: dict[str, Any] = {
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


@dataclass(frozen=True)
class PanAndScan:
    """Gemma 3's pan-and-scan settings (transformers' names without `pan_and_scan_`)."""

    min_crop_size: int
    max_num_crops: int
    min_ratio_to_activate: float

    def kwargs(self) -> dict[str, Any]:
        """As the image processor takes them."""
        return {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": self.min_crop_size,
                "pan_and_scan_max_num_crops": self.max_num_crops,
                "pan_and_scan_min_ratio_to_activate": self.min_ratio_to_activate}


def pan_and_scan_of(settings: ProcessorSettings | None) -> PanAndScan | None:
    """The pan-and-scan an engine runs with (None: off): preprocessor_config.json's settings,
    its nulls transformers' processor defaults, the engine's mm_processor_kwargs over both.
    A bad value is refused by name."""
    settings = settings or ProcessorSettings()
    values = dict(PAN_AND_SCAN_DEFAULTS)
    if settings.model_path is not None:
        values.update({k: v for k, v in _file_settings(settings.model_path).items()
                       if k in values and v is not None})
    values.update(settings.kwargs)
    enabled = values["do_pan_and_scan"]
    if not isinstance(enabled, bool):
        raise ValueError(f"do_pan_and_scan must be true or false, got {enabled!r}")
    if not enabled:
        return None
    ints = ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops")
    for name in ints:
        if isinstance(values[name], bool) or not isinstance(values[name], int) \
                or values[name] < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {values[name]!r}")
    ratio = values["pan_and_scan_min_ratio_to_activate"]
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio > 0:
        raise ValueError(f"pan_and_scan_min_ratio_to_activate must be a number > 0, got "
                         f"{ratio!r}")
    return PanAndScan(values[ints[0]], values[ints[1]], float(ratio))


def _file_settings(model_path: str) -> dict[str, Any]:
    # Expanded as the front's processor expands it: the engine's budgets get the path as
    # configured (`~/...` included) and must read the same file.
    path = Path(model_path).expanduser() / "preprocessor_config.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def check_config(config: PretrainedConfig) -> None:
    """A Gemma 3 config we run: a SigLIP tower whose patch grid pools evenly."""
    vision = config.vision_config
    vision_type = getattr(vision, "model_type", "")
    if vision_type != "siglip_vision_model":
        raise ValueError(f"Gemma 3 with a {vision_type!r} vision tower is not supported "
                         "(SigLIP only)")
    side = vision.image_size // vision.patch_size
    per_side = int(round(config.mm_tokens_per_image ** 0.5))
    if per_side * per_side != config.mm_tokens_per_image or side % per_side:
        raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} does not pool a "
                         f"{side} x {side} patch grid evenly")


class Gemma3Processor(MultiModalProcessor):
    """`<start_of_image>` -> Gemma 3's image sequence (with its crops under pan-and-scan);
    pixels by its image processor."""

    image_placeholder = "<start_of_image>"
    accepted_kwargs = tuple(PAN_AND_SCAN_DEFAULTS)

    def __init__(self, hf_config: Any, tokenizer: Any, model_path: str | None,
                 processor_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(hf_config, tokenizer, model_path, processor_kwargs)
        from transformers import Gemma3ImageProcessorPil

        check_config(hf_config)
        self.boi_id = int(hf_config.boi_token_index)
        self.eoi_id = int(hf_config.eoi_token_index)
        self.image_id = int(hf_config.image_token_index)
        self.num_image_tokens = int(hf_config.mm_tokens_per_image)
        self.pan_and_scan = pan_and_scan_of(ProcessorSettings(model_path, self.kwargs))
        self._sequences: dict[int, list[int]] = {}
        # What images need beyond the model: without it the checkpoint still serves text, and
        # a prompt with images is refused by name (`missing`).
        self.missing: list[str] = []
        self.newlines_id = double_newline_id(tokenizer)
        if self.newlines_id is None:
            self.missing.append("a tokenizer with Gemma's '\\n\\n' token, which frames every "
                                "image")
        self.image_processor = None
        if model_path is None or not (Path(model_path) / "preprocessor_config.json").is_file():
            self.missing.append("its preprocessor_config.json (the image processor's settings)")
        else:
            self.image_processor = Gemma3ImageProcessorPil.from_pretrained(model_path)
        if tokenizer is not None:
            self.image_placeholder = tokenizer.convert_ids_to_tokens(self.boi_id)
        if self.pan_and_scan is not None and tokenizer is not None and not self.missing:
            self._check_crops_text()

    def process(self, prompt_token_ids: list[int], images: list[Any]) -> MultiModalPrompt:
        if images and self.missing:
            raise ValueError("this Gemma 3 checkpoint cannot take images: it lacks "
                             + " and ".join(self.missing))
        return expand_images(
            prompt_token_ids, images, self._image_data, marker=self.boi_id,
            marker_text=self.image_placeholder, image_token=self.image_id,
            rows=self.num_image_tokens, hidden=self.hf_config.text_config.hidden_size,
            tag="gemma3", before=(self.newlines_id, self.boi_id),
            after=(self.eoi_id, self.newlines_id), several=self.crops_sequence)

    def _image_data(self, images: list[Any]) -> list[dict[str, torch.Tensor]]:
        return image_inputs(images, self._pixels)

    def _pixels(self, pil: list[Any]) -> torch.Tensor | list[torch.Tensor]:
        """[n, C, H, W] without pan-and-scan; with it, per image its [C, H, W] square when
        it was not cropped (as without), else [1 + crops, C, H, W]: the original first."""
        if self.pan_and_scan is None:
            return self.image_processor(images=pil, do_pan_and_scan=False,
                                        return_tensors="pt")["pixel_values"]
        out = self.image_processor(images=pil, return_tensors="pt",
                                   **self.pan_and_scan.kwargs())
        squares = [1 + int(n) for n in out["num_crops"]]
        return [part[0] if len(part) == 1 else part
                for part in out["pixel_values"].split(squares)]

    def crops_sequence(self, squares: int) -> list[int]:
        """The tokens of an image of `squares` squares (the original and its crops):
        transformers' Gemma3Processor's text for it, tokenized whole (its special tokens
        split the text as in a prompt) by the model's tokenizer; made once per count."""
        if squares not in self._sequences:
            name = self.tokenizer.convert_ids_to_tokens
            one = ("\n\n" + name(self.boi_id) + name(self.image_id) * self.num_image_tokens
                   + name(self.eoi_id) + "\n\n")
            text = (f"Here is the original image {one} and here are some crops to help you "
                    "see better " + " ".join([one] * (squares - 1)))
            self._sequences[squares] = self.tokenizer.encode(text, add_special_tokens=False)
        return list(self._sequences[squares])

    def _check_crops_text(self) -> None:
        """The tokenizer must give each square of the crops text its own soft tokens."""
        ids = self.crops_sequence(2)
        if ids.count(self.image_id) != 2 * self.num_image_tokens:
            raise ValueError("do_pan_and_scan: the tokenizer does not encode transformers' "
                             "crops text to one <image_soft_token> per image row; turn "
                             "pan-and-scan off")


def double_newline_id(tokenizer: Any) -> int | None:
    """The id of Gemma's "\\n\\n" token, which frames every image sequence (None: the
    tokenizer has none)."""
    if tokenizer is None:
        return None
    token_id = tokenizer.convert_tokens_to_ids("\n\n")
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
        # A vocabulary that spells the token otherwise: what the text encodes to, if one id.
        ids = tokenizer.encode("\n\n", add_special_tokens=False)
        token_id = ids[0] if len(ids) == 1 else None
    return None if token_id is None else int(token_id)
