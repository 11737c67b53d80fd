"""Images as the reference preprocessor (transformers' Qwen2VLImageProcessorPil, which
Qwen3.5 / Qwen3.6 use) prepares them: converted to RGB (transparency over white), resized
with PIL to the profile's smart-resize size, then rescaled, normalised and cut into the
tower's flattened patches."""

from __future__ import annotations

import hashlib

from PIL import Image

from helexa.engine.vision.inputs import ImageInput, VisionProfile


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited over white (as the reference's convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resize_image(image: Image.Image, profile: VisionProfile) -> ImageInput:
    """`image` (decoded, within the node's limits) resized for the tower: an ImageInput.
    Raises ImageSizeError for an image no resize fits (more elongated than 200:1)."""
    rgb = to_rgb(image)
    height, width = profile.resized(rgb.height, rgb.width)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), resample=Image.Resampling(profile.resample))
    data = rgb.tobytes()
    digest = hashlib.sha256(f"{height}x{width}:".encode() + data).hexdigest()
    return ImageInput(data, height, width, digest)
