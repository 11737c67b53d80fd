"""Images as the reference preprocessor (transformers' Qwen2VLImageProcessorPil, which
Qwen3.5 / Qwen3.6 use) prepares them: converted to RGB (transparency over white), resized
with PIL to the profile's smart-resize size, then rescaled, normalised and cut into the
tower's flattened patches."""

from __future__ import annotations

import hashlib

import torch
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
    Raises ImageSizeError for an image no resize fits (more elongated than 200:1).

    PIL resizes the uint8 RGB image, as the reference's PIL backend does (it hands PIL its
    uint8 array and rescales only after): the resized bytes are the reference's, bit for bit."""
    rgb = to_rgb(image)
    height, width = profile.resized(rgb.height, rgb.width)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), resample=Image.Resampling(profile.resample))
    data = rgb.tobytes()
    digest = hashlib.sha256(f"{height}x{width}:".encode() + data).hexdigest()
    return ImageInput(data, height, width, digest)


def patches(image: ImageInput, profile: VisionProfile) -> torch.Tensor:
    """The tower's input for one image: float32 `[grid_h * grid_w, in_channels *
    temporal_patch_size * patch * patch]`, one row a patch, rows in merge-block order (the
    merge² patches that become one language-model token are adjacent), a row laid out
    (channel, time, y, x) with the single frame repeated along time."""
    p, m, t = profile.patch_size, profile.merge_size, profile.temporal_patch_size
    _, grid_h, grid_w = image.grid(profile)
    assert profile.in_channels == 3, f"an RGB image for a tower of {profile.in_channels} channels"
    assert grid_h % m == 0 and grid_w % m == 0, f"grid {grid_h}x{grid_w} not a multiple of {m}"
    # pixels: [height, width, 3] uint8
    pixels = torch.frombuffer(bytearray(image.rgb), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, 3)
    # The reference rescales in float64 and rounds to float32 once, then normalises in
    # float32; doing the same keeps the patches bit-identical to the reference's.
    x = pixels.to(torch.float64)
    if profile.do_rescale:
        x = x * profile.rescale_factor
    x = x.to(torch.float32)
    if profile.do_normalize:
        mean = torch.tensor(profile.image_mean, dtype=torch.float32)
        std = torch.tensor(profile.image_std, dtype=torch.float32)
        x = (x - mean) / std
    # [block_h, m, p, block_w, m, p, C] -> [block_h, block_w, m, m, C, p, p]
    x = x.view(grid_h // m, m, p, grid_w // m, m, p, 3).permute(0, 3, 1, 4, 6, 2, 5)
    # The temporal axis repeats the one frame: [..., C, t, p, p]
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)
    return x.reshape(grid_h * grid_w, 3 * t * p * p)
