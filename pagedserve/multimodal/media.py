"""Images as requests carry them, to what a processor takes: `data:` URLs (base64) and local
files decoded by pillow, and precomputed embeddings in vLLM's `image_embeds` form (base64 of
`torch.save`'s bytes). Nothing is fetched over a network.

Two steps, so that a server refuses cheaply before it decodes anything: `parse_image_url` /
`parse_image_embeds` check a reference and say where its bytes are (no decoding); `load` reads
and decodes them (the slow part, which a server runs on a worker pool). Every refusal is a
`MediaError` naming the problem."""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
from PIL import Image, UnidentifiedImageError

# 32 Mi pixels: an 8192 x 4096 image, 96 MiB as RGB. Vision processors resize to well under a
# megapixel; a larger image only costs the decode.
DEFAULT_MAX_IMAGE_PIXELS = 32 << 20


class MediaError(ValueError):
    """An image a request carries that cannot be taken (the message says why)."""


@dataclass(frozen=True)
class MediaSource:
    """Where one item's bytes are: base64 text (of an encoded image or of a saved tensor),
    or a local file already checked against the allowed directory."""

    kind: str  # "image" or "embeds"
    base64: str | None = None
    path: Path | None = None
    # Embeddings of the Qwen-VL family also carry their image's patch grid (t, h, w): base64
    # of a saved int tensor, as vLLM's `image_grid_thw` field.
    grid_base64: str | None = None


def parse_image_url(url: str, allowed_local_path: str | Path | None) -> MediaSource:
    """A `data:` URL, or a `file://` URL / absolute path inside `allowed_local_path`
    (symlinks resolved). http(s) and every other scheme are refused: no network fetches."""
    if url.startswith("data:"):
        return MediaSource("image", base64=_data_url_payload(url))
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        raise MediaError("remote image URLs are not fetched: this server makes no network "
                         "requests; send the image as a data: URL (base64)")
    if scheme == "file":
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"file URL {url[:80]!r} names host {parsed.netloc!r}: only local "
                             "files (file:///path) are read")
        return MediaSource("image", path=_allowed_file(unquote(parsed.path), allowed_local_path))
    if scheme and len(scheme) > 1:  # "c:" would be a Windows drive, not a scheme
        raise MediaError(f"image URL scheme {scheme!r} is not supported: send a data: URL "
                         "(base64) or a file under --allowed-local-media-path")
    return MediaSource("image", path=_allowed_file(url, allowed_local_path))


def parse_image_embeds(data: str, grid: str | None = None) -> MediaSource:
    return MediaSource("embeds", base64=data, grid_base64=grid)


def _data_url_payload(url: str) -> str:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("data: URL has no ',' before its data (data:image/png;base64,...)")
    params = header[len("data:"):].split(";")
    if "base64" not in params[1:]:
        raise MediaError(f"data: URL {header!r} is not base64: send data:<type>;base64,<data>")
    media_type = params[0].lower()
    if media_type and not media_type.startswith("image/") \
            and media_type != "application/octet-stream":
        raise MediaError(f"data: URL media type {media_type!r} is not an image type")
    return payload


def _allowed_file(path_text: str, allowed_local_path: str | Path | None) -> Path:
    if allowed_local_path is None:
        raise MediaError("local image files are not read: the server was started without "
                         "--allowed-local-media-path; send the image as a data: URL (base64)")
    if not Path(path_text).is_absolute():
        raise MediaError(f"image path {path_text[:200]!r} is not absolute: give file:///path or "
                         "/path inside --allowed-local-media-path")
    root = Path(allowed_local_path).resolve()
    try:
        resolved = Path(path_text).resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaError(f"image file {path_text[:200]!r} does not exist or cannot be "
                         "resolved") from None
    if not resolved.is_relative_to(root):
        raise MediaError(f"image file {path_text[:200]!r} is outside the allowed directory "
                         "(--allowed-local-media-path); symlinks are followed before the check")
    if not resolved.is_file():
        raise MediaError(f"image path {path_text[:200]!r} is not a regular file")
    return resolved


# ---- decoding (a worker pool's work) ------------------------------------------------------


def load(source: MediaSource, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
         ) -> Image.Image | torch.Tensor | dict[str, torch.Tensor]:
    """The item itself: an RGB PIL image, an embeddings tensor [n, hidden], or with a grid
    {"image_embeds": [n, hidden], "image_grid_thw": [3]}."""
    if source.path is not None:
        try:
            size = source.path.stat().st_size
            # No encoding takes much more than 4 bytes a pixel (uncompressed RGBA): a larger
            # file is refused before it is read into memory.
            if size > 4 * max_pixels + (1 << 20):
                raise MediaError(f"image file {str(source.path)!r} is {size} bytes, more than "
                                 f"an image of at most {max_pixels} pixels takes "
                                 "(--max-image-pixels)")
            raw = source.path.read_bytes()
        except OSError as exc:
            raise MediaError(f"cannot read image file {str(source.path)!r}: "
                             f"{exc.strerror}") from None
    else:
        raw = _b64decode(source.base64 or "")
    if source.kind != "embeds":
        return decode_image(raw, max_pixels)
    if source.grid_base64 is None:
        return decode_embeds(raw)
    return {"image_embeds": decode_embeds(raw),
            "image_grid_thw": decode_grid(_b64decode(source.grid_base64))}


def _b64decode(text: str) -> bytes:
    try:
        # Line breaks some encoders insert are not data; anything else outside the alphabet
        # is an error, not silently dropped.
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"the image data is not valid base64: {exc}") from None


def decode_image(raw: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Encoded bytes -> an RGB image. The size is checked from the header, before the pixels
    are decoded (a small file can claim a huge image); `load()` reads every byte, so a
    truncated file is refused here, not half-decoded later."""
    if not raw:
        raise MediaError("the image data is empty")
    try:
        with warnings.catch_warnings():  # the limit below decides, not pillow's bomb warning;
            warnings.simplefilter("ignore")  # and a corrupt header's warnings end in an error
            image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError as exc:
        raise MediaError(f"the image is too large to decode: {exc}") from None
    except UnidentifiedImageError:
        raise MediaError("the image data is not an image pillow can read (PNG, JPEG, GIF, "
                         "WebP, BMP, TIFF, ...)") from None
    except Exception as exc:  # a known format whose header is broken: the data's fault
        raise MediaError(f"the image header is corrupt: {type(exc).__name__}: "
                         f"{str(exc)[:200]}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"the image is {width}x{height} = {width * height} pixels, more than "
                         f"this server's limit of {max_pixels} (--max-image-pixels)")
    try:
        with warnings.catch_warnings():  # corrupt EXIF and the like: refused or decoded
            warnings.simplefilter("ignore")
            image.load()
            return to_rgb(image)
    except Exception as exc:  # pillow's decoders raise OSError, ValueError, struct.error...
        raise MediaError(f"the image is truncated or corrupt: {str(exc)[:200]}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparent pixels over white, as transformers' `convert_to_rgb` and vLLM do
    (a plain convert("RGB") would keep the colour hidden under alpha 0)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_embeds(raw: bytes) -> torch.Tensor:
    """vLLM's image_embeds: `torch.save` of one image's embeddings [n, hidden] (or [1, n,
    hidden])."""
    tensor = _saved_tensor(raw, "image_embeds")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] == 0:
        raise MediaError(f"image_embeds must be one image's embeddings [tokens, hidden], got "
                         f"shape {list(tensor.shape)}")
    if not tensor.is_floating_point():
        raise MediaError(f"image_embeds must be floating point, got {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise MediaError("image_embeds holds NaN or infinite values")
    return tensor


def decode_grid(raw: bytes) -> torch.Tensor:
    """vLLM's image_grid_thw: `torch.save` of one image's (t, h, w) patch grid, shape [3] or
    [1, 3], positive integers; int64 [3]."""
    grid = _saved_tensor(raw, "image_grid_thw")
    if grid.dim() == 2 and grid.shape[0] == 1:
        grid = grid[0]
    if grid.shape != (3,) or grid.is_floating_point() or grid.is_complex() \
            or grid.dtype == torch.bool or not bool((grid > 0).all()):
        raise MediaError(f"image_grid_thw must be one image's (t, h, w) positive integers, "
                         f"got shape {list(grid.shape)} {grid.dtype}")
    return grid.to(torch.int64)


def _saved_tensor(raw: bytes, name: str) -> torch.Tensor:
    """A tensor from `torch.save`'s bytes, loaded with weights_only (no code runs) and sparse
    tensors' invariants checked, then made dense."""
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor: Any = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to_dense()
    except Exception as exc:  # any unpickling failure is the payload's fault
        raise MediaError(f"{name} is not a tensor saved with torch.save: "
                         f"{type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(tensor, torch.Tensor):
        raise MediaError(f"{name} holds a {type(tensor).__name__}, not a tensor")
    return tensor
