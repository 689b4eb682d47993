"""Chat messages with images: OpenAI-style content parts taken apart into the messages a chat
template renders and the images, in order, that the rendered placeholders stand for."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]
IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def load_data_url(url: str) -> Any:
    """A `data:image/...;base64,...` URL as an RGB PIL image, decoded now (a bad image is the
    caller's error, not the engine's) with the server's safeguards (multimodal/media.py: the
    pixel limit read from the header, truncated files caught). Nothing is fetched: a remote URL
    or a local path is refused (the server takes files under --allowed-local-media-path)."""
    from pagedserve.multimodal import media

    if not isinstance(url, str):
        raise ValueError(f"image_url must be a string URL, not {type(url).__name__}")
    return media.load(media.parse_image_url(url, None))


def _part_image(part: dict[str, Any]) -> Any:
    kind = part["type"]
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        return load_data_url(url)
    image = part.get(kind)
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"a {kind!r} content part must carry a PIL image under {kind!r}")
    return image


def chat_images(messages: list[Message]) -> tuple[list[Message], list[Any]]:
    """(messages for the template, images in order). A message whose content parts hold
    images keeps its parts, each image as {"type": "image"}; one with text parts only has
    them joined into a string (what every template renders)."""
    out: list[Message] = []
    images: list[Any] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise ValueError(f"a content part must be a dict with a 'type', got {part!r}")
            if part["type"] == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif part["type"] in IMAGE_PART_TYPES:
                images.append(_part_image(part))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"content part type {part['type']!r} is not supported "
                                 f"(text, {', '.join(IMAGE_PART_TYPES)})")
        if all(p["type"] == "text" for p in parts):
            out.append({**message, "content": "\n".join(p["text"] for p in parts)})
        else:
            out.append({**message, "content": parts})
    return out, images


def _as_strings(messages: list[Message], placeholder: str) -> list[Message]:
    """Each image part as the model's placeholder text before the message's text (for
    templates that render only string content)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            images = sum(p["type"] == "image" for p in content)
            text = "\n".join(p["text"] for p in content if p["type"] == "text")
            content = f"{placeholder}\n" * images + text
        out.append({**message, "content": content})
    return out


def render_with_images(tokenizer: Any, messages: list[Message], num_images: int,
                       placeholder: str, add_generation_prompt: bool = True,
                       chat_template: str | None = None,
                       continue_final_message: bool = False) -> list[int]:
    """Prompt token ids with one `placeholder` per image: the template's own rendering of
    image parts when it has one, else the placeholders before each message's text."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template")
    extra = {"continue_final_message": True} if continue_final_message else {}
    text = None
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tokenize=False,
                                             **extra)
    except Exception:  # a template that takes string content only (jinja raised on a list)
        text = None
    if text is None or text.count(placeholder) != num_images:
        text = tokenizer.apply_chat_template(_as_strings(messages, placeholder),
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tokenize=False,
                                             **extra)
    if text.count(placeholder) != num_images:
        raise ValueError(f"the chat template rendered {text.count(placeholder)} image "
                         f"placeholders ({placeholder}) for {num_images} images")
    return tokenizer.encode(text, add_special_tokens=False)
