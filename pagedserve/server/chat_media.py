"""Images in chat requests. Content parts become the chat template's messages (an image part
becomes `{"type": "image"}`, where transformers' templates put the model's placeholder) and a
list of the images' sources; every refusal that needs no decoding (a remote URL, a path outside
`--allowed-local-media-path`, too many images, images to a text-only model) comes first, on the
event loop. Decoding and the model's processor then run on `MediaPool`'s threads, off the event
loop and off the engine's step loop, and their refusals (not base64, not an image, truncated,
too many pixels, placeholders that do not match) are 400s too."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.multimodal.front import process_prompt
from pagedserve.multimodal.inputs import MultiModalPrompt
from pagedserve.multimodal.media import (
    DEFAULT_MAX_IMAGE_PIXELS,
    MediaError,
    MediaSource,
    load,
    parse_image_embeds,
    parse_image_url,
)
from pagedserve.server import protocol as p
from pagedserve.server.common import ApiError

IMAGE_PARTS = ("image_url", "image_embeds")
# A string no template writes by itself: whether it survives rendering tells whether the
# template prints plain-string content (llava-hf's templates read typed parts only).
PROBE = "\ue000pagedserve-probe\ue001"


@dataclass
class ImageItem:
    where: str  # the request field it came from, for errors: messages.1.content.0
    source: MediaSource


@dataclass
class TemplateInput:
    """A chat request as its template renders it, and its images in prompt order."""

    messages: list[dict[str, Any]]
    images: list[ImageItem] = field(default_factory=list)


@dataclass
class MediaSettings:
    """The server's flags for images (ServerConfig fields of the same names)."""

    allowed_local_media_path: str | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    enable_mm_embeds: bool = False
    media_workers: int | None = None


class MediaPool:
    """The threads that decode images and run the model's processor. Pillow's decoders and
    the image processors' numpy work release the GIL for most of their time, so a few threads
    keep several requests' images going while the event loop serves others."""

    def __init__(self, settings: MediaSettings | None = None) -> None:
        self.settings = settings or MediaSettings()
        workers = self.settings.media_workers or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="pagedserve-media")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def load_all(self, images: list[ImageItem], processor: Any) -> list[Any]:
        """Every image decoded (in parallel): PIL images, or embeddings tensors."""
        loop = asyncio.get_running_loop()
        max_pixels = self.settings.max_image_pixels
        loaded = await asyncio.gather(
            *(loop.run_in_executor(self._pool, load, item.source, max_pixels)
              for item in images), return_exceptions=True)
        for item, result in zip(images, loaded, strict=True):
            if isinstance(result, MediaError):
                raise ApiError(400, f"{item.where}: {result}", param=item.where)
            if isinstance(result, BaseException):
                raise result
            embeds = result.get("image_embeds") if isinstance(result, dict) else result
            if isinstance(embeds, torch.Tensor):
                _check_embeds_width(processor, embeds, item.where)
        return list(loaded)

    async def process(self, processor: Any, token_ids: list[int], items: list[Any],
                      limits: dict[str, int] | None, model_name: str) -> MultiModalPrompt:
        """The prompt's placeholders expanded by the model's processor."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, process_prompt, processor, token_ids,
                                              {"image": items}, limits, model_name)
        except ValueError as exc:  # placeholders and images that do not match, and the like
            raise ApiError(400, f"messages: {exc}", param="messages") from None


def _check_embeds_width(processor: Any, embeds: torch.Tensor, where: str) -> None:
    width = processor.embeds_width
    if embeds.shape[-1] != width:
        raise ApiError(400, f"{where}: image_embeds rows are {embeds.shape[-1]} wide, this "
                            f"model's image embeddings are {width} wide", param=where)


# ---- content parts -> the template's messages -----------------------------------------------


def template_input(messages: list[p.ChatMessage], processor: Any, image_limit: int | None,
                   settings: MediaSettings, model_name: str) -> TemplateInput:
    """The messages as the template takes them. A message with images keeps its parts as a
    list (text parts and `{"type": "image"}`); one without is its text joined, as before."""
    out = TemplateInput([])
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            content = _content(i, message, content, out.images, processor, settings,
                               model_name)
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            item["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:  # Qwen3's template renders it inside a tool loop; others ignore it
            item["reasoning_content"] = reasoning
        out.messages.append(item)
    count = len(out.images)
    if image_limit is not None and count > image_limit:
        raise ApiError(400, f"this request carries {count} image{'s' * (count != 1)}, more "
                            f"than the {image_limit} per prompt this server takes "
                            "(--limit-mm-per-prompt)", param="messages")
    return out


def _content(i: int, message: p.ChatMessage, parts: list[p.ContentPart],
             images: list[ImageItem], processor: Any, settings: MediaSettings,
             model_name: str) -> str | list[dict[str, Any]]:
    rendered: list[dict[str, Any]] = []
    has_image = False
    for j, part in enumerate(parts):
        where = f"messages.{i}.content.{j}"
        if part.type == "text":
            if part.text is None:
                raise ApiError(400, f"{where}: a text part needs text", param=where)
            rendered.append({"type": "text", "text": part.text})
            continue
        if part.type not in IMAGE_PARTS:
            raise ApiError(400, f"{where}: content part type {part.type!r} is not supported "
                                "(text, image_url, image_embeds)", param=where)
        if processor is None:
            raise ApiError(400, f"{where}: images need a vision-language model; "
                                f"{model_name} takes text only", param=where)
        if message.role != "user":
            raise ApiError(400, f"{where}: images go in user messages, not {message.role} "
                                "messages", param=where)
        images.append(ImageItem(where, _source(part, where, settings)))
        rendered.append({"type": "image"})
        has_image = True
    if has_image:
        return rendered
    # One line per part, as vLLM joins them: "Hi" and "there" are not the word "Hithere".
    return "\n".join(part["text"] for part in rendered)


def _source(part: p.ContentPart, where: str, settings: MediaSettings) -> MediaSource:
    try:
        if part.type == "image_url":
            url = part.image_url if isinstance(part.image_url, str) else \
                part.image_url.url if part.image_url is not None else None
            if not url:
                raise MediaError("an image_url part needs image_url.url")
            return parse_image_url(url, settings.allowed_local_media_path)
        if not settings.enable_mm_embeds:
            raise MediaError("image_embeds parts are off: start the server with "
                             "--enable-mm-embeds (for trusted clients only)")
        embeds, grid = part.image_embeds, None
        if isinstance(embeds, dict):
            extra = sorted(set(embeds) - {"image_embeds", "image_grid_thw"})
            if extra:
                raise MediaError(f"image_embeds fields {', '.join(extra)} are not supported "
                                 "(image_embeds, and image_grid_thw for the Qwen-VL family)")
            embeds, grid = embeds.get("image_embeds"), embeds.get("image_grid_thw")
            if grid is not None and (not isinstance(grid, str) or not grid):
                raise MediaError("image_grid_thw must be base64 of a tensor saved with "
                                 "torch.save")
        if not embeds or not isinstance(embeds, str):
            raise MediaError("an image_embeds part needs image_embeds (base64 of a tensor "
                             "saved with torch.save)")
        return parse_image_embeds(embeds, grid)
    except MediaError as exc:
        raise ApiError(400, f"{where}: {exc}", param=where) from None


def as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain-string contents as one text part, for templates that read typed parts only."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m.get("content"), str) else m for m in messages]


def template_reads_parts(tokenizer: Any, chat_template: str | None) -> bool:
    """Whether the template wants typed parts: it drops plain-string content (llava-hf's
    templates), or fails on it where it prints a text part."""
    def render(content: Any) -> str | None:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                 chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=False)
        except Exception:  # the template cannot take this form of content
            return None
        return text if isinstance(text, str) else None

    as_string = render(PROBE)
    if as_string is not None:
        return PROBE not in as_string
    as_part = render([{"type": "text", "text": PROBE}])
    return as_part is not None and PROBE in as_part
