"""Image sizes as the Qwen vision models see them, with no torch: the gateway estimates a
request's image tokens with these, the node sizes the images it decodes with them.

`smart_resize` is the Qwen2-VL / Qwen3-VL preprocessor's: both sides a multiple of `factor`
(patch × merge), the aspect ratio kept as closely as it can be, the pixel count between
`min_pixels` and `max_pixels`.
"""

from __future__ import annotations

import math

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
