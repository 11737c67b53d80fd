"""Image sizes as the Qwen vision models see them, with no torch: the gateway estimates a
request's image tokens with these, the node sizes the images it decodes with them.

`smart_resize` is the Qwen2-VL / Qwen3-VL preprocessor's: both sides a multiple of `factor`
(patch × merge), the aspect ratio kept as closely as it can be, the pixel count between
`min_pixels` and `max_pixels`.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any

from PIL import Image

MAX_ASPECT_RATIO = 200  # the reference refuses images more elongated than this


class ImageSizeError(ValueError):
    """An image no resize can bring into the model's bounds (too elongated)."""


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) resized: multiples of `factor`, aspect kept, pixels within bounds."""
    if height < 1 or width < 1:
        raise ImageSizeError(f"an image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(
            f"an image of {width}x{height} pixels is more elongated than "
            f"{MAX_ASPECT_RATIO}:1, which the vision model cannot take"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_tokens(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> int:
    """The language-model tokens an image of this size becomes: one per factor² pixels of
    its resized size."""
    h, w = smart_resize(height, width, factor, min_pixels, max_pixels)
    return (h // factor) * (w // factor)


# -- the gateway's estimate ----------------------------------------------------------------
# Qwen3.5 / Qwen3.6 images as a node sizes them by default: 16-pixel patches merged 2×2, the
# node's 256²…1024² bounds, capped by the tower's 2304 patches (589824 pixels, 576 tokens).
ESTIMATE_FACTOR = 32
ESTIMATE_MIN_PIXELS = 256 * 256
ESTIMATE_MAX_PIXELS = min(1024 * 1024, 2304 * 16 * 16)
MAX_IMAGE_TOKENS = ESTIMATE_MAX_PIXELS // (ESTIMATE_FACTOR * ESTIMATE_FACTOR)
MIN_IMAGE_TOKENS = ESTIMATE_MIN_PIXELS // (ESTIMATE_FACTOR * ESTIMATE_FACTOR)
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_HEADER_CHARS = 1 << 16  # base64 read for a header: PNG, GIF and most JPEGs show their size
_WHOLE_CHARS = 1 << 21  # past the header, a payload up to this is read whole (WebP, EXIF)


@dataclass(frozen=True, slots=True)
class ImageEstimate:
    """What a request's images add to its prompt: their tokens, and the characters of their
    encoded data (base64, URLs), which are not text and must not be counted as such."""

    num_images: int = 0
    num_tokens: int = 0
    num_chars: int = 0


def estimate_images(body: Any, unreadable: int = MAX_IMAGE_TOKENS) -> ImageEstimate:
    """The image parts anywhere in a request body (OpenAI `image_url`, Responses
    `input_image`, Anthropic `image` blocks, nested in tool results too), each estimated
    at its tokens (`estimate_image_tokens`)."""
    num_images = num_tokens = num_chars = 0
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            source = _image_source(value)
            if source is None:
                stack.extend(value.values())
            else:
                num_images += 1
                num_tokens += estimate_image_tokens(source, unreadable)
                num_chars += len(source)
    return ImageEstimate(num_images, num_tokens, num_chars)


def estimate_image_tokens(source: str, unreadable: int = MAX_IMAGE_TOKENS) -> int:
    """An image's tokens: from its size read off a data URL's (or a bare base64 payload's)
    header with no decode, at the default factor and bounds; `unreadable` when the size
    cannot be read (a remote URL, a file id, an unknown format, one the node refuses):
    the upper bound for a budget, the least an image can be for a check that must not
    refuse what the node would take (or refuse better)."""
    size = image_size(source)
    if size is None:
        return unreadable
    try:
        return image_tokens(*size, ESTIMATE_FACTOR, ESTIMATE_MIN_PIXELS, ESTIMATE_MAX_PIXELS)
    except ImageSizeError:  # too elongated: the node refuses it, with its own 400
        return unreadable


def image_size(source: str) -> tuple[int, int] | None:
    """(height, width) from the header of a base64 image (`data:…;base64,` URL or bare
    payload), or None. Pillow reads the header only; no pixel is decoded."""
    if source.startswith("data:"):
        header, _, source = source.partition(",")
        if "base64" not in header:
            return None
    elif ":" in source[:16]:  # a remote URL: its size is not here
        return None
    for num_chars in (_HEADER_CHARS, _WHOLE_CHARS):
        size = _header_size(source[: num_chars - num_chars % 4])
        if size is not None or len(source) <= num_chars:
            return size
    return None


def _header_size(payload: str) -> tuple[int, int] | None:
    try:
        data = base64.b64decode(payload)
        with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            width, height = image.size
    except Exception:  # any unreadable header: the caller falls back to the upper bound
        return None
    return height, width


def _image_source(part: dict[str, Any]) -> str | None:
    """The URL or base64 data of an image part, "" for one without either, None for a
    dict that is no image part."""
    kind = part.get("type")
    if kind == "image_url":  # OpenAI chat: {"image_url": {"url": …}} (or a bare string)
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        return url if isinstance(url, str) else ""
    if kind == "input_image":  # Responses: {"image_url": "…"} or {"file_id": "…"}
        url = part.get("image_url")
        return url if isinstance(url, str) else ""
    if kind == "image":  # Anthropic: {"source": {"type": "base64", "data"} | {"url"}}
        source = part.get("source")
        if not isinstance(source, dict):
            return ""
        found = source.get("data") if source.get("type") == "base64" else source.get("url")
        return found if isinstance(found, str) else ""
    return None
