"""The image profile of a vision-language checkpoint, and an image as the engine takes it."""

from __future__ import annotations

from typing import Any

import msgspec

from helexa.protocol.images import image_tokens, smart_resize

# The seeds' bounds: 256²…1024² pixels, 64…1024 tokens an image at factor 32 (before the
# tower's own cap, which is lower for Qwen3.5 / Qwen3.6: 2304 patches, 576 tokens).
DEFAULT_MIN_PIXELS = 256 * 256
DEFAULT_MAX_PIXELS = 1024 * 1024


class VisionProfile(msgspec.Struct, frozen=True):
    """How a checkpoint wants its images: from config.json's `vision_config` and token ids
    and preprocessor_config.json's normalisation; the pixel bounds are the node's
    (configurable), clamped so that no resized image exceeds the tower's learned position
    grid (`max_patches`), whatever its aspect ratio."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    in_channels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_rescale: bool
    do_normalize: bool
    resample: int  # PIL's resampling filter (3: bicubic)
    min_pixels: int
    max_pixels: int
    max_patches: int  # the tower's num_position_embeddings
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one language-model token per factor²."""
        return self.patch_size * self.merge_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) in pixels an image is resized to (ImageSizeError if none)."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """Language-model tokens of an image of this (original) size."""
        return image_tokens(height, width, self.factor, self.min_pixels, self.max_pixels)

    def bounded(self, min_pixels: int, max_pixels: int) -> VisionProfile:
        """This profile with the node's pixel bounds, clamped as `from_configs` does."""
        low, top = _clamped(self.patch_size, self.factor, self.max_patches, min_pixels, max_pixels)
        return msgspec.structs.replace(self, min_pixels=low, max_pixels=top)

    @classmethod
    def from_configs(
        cls,
        config: dict[str, Any],
        preprocessor: dict[str, Any] | None,
        *,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> VisionProfile:
        """From config.json (with `vision_config`) and preprocessor_config.json (None: the
        Qwen3-VL processor's defaults)."""
        vision = config["vision_config"]
        pre = preprocessor or {}
        patch = int(pre.get("patch_size", vision.get("patch_size", 16)))
        merge = int(pre.get("merge_size", vision.get("spatial_merge_size", 2)))
        max_patches = int(vision.get("num_position_embeddings", 2304))
        low, top = _clamped(patch, patch * merge, max_patches, min_pixels, max_pixels)
        return cls(
            patch_size=patch,
            merge_size=merge,
            temporal_patch_size=int(
                pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2))
            ),
            in_channels=int(vision.get("in_channels", 3)),
            image_mean=tuple(float(v) for v in pre.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(v) for v in pre.get("image_std", (0.5, 0.5, 0.5))),
            rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
            do_rescale=bool(pre.get("do_rescale", True)),
            do_normalize=bool(pre.get("do_normalize", True)),
            resample=int(pre.get("resample", 3)),
            min_pixels=low,
            max_pixels=top,
            max_patches=max_patches,
            image_token_id=int(config.get("image_token_id", 248056)),
            vision_start_token_id=int(config.get("vision_start_token_id", 248053)),
            vision_end_token_id=int(config.get("vision_end_token_id", 248054)),
        )


def _clamped(
    patch: int, factor: int, max_patches: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(min, max) pixels: at least one token, at most the tower's position grid (smart_resize
    floors under max_pixels, so no resized image exceeds `max_patches` patches)."""
    cap = max_patches * patch * patch
    top = max(factor * factor, min(max_pixels, cap))
    return max(factor * factor, min(min_pixels, top)), top


class ImageInput(msgspec.Struct, frozen=True, array_like=True):
    """One image of a prompt, decoded and resized by the node (preprocess.resize_image):
    what crosses to the worker, and what the prefix cache keys the image by."""

    rgb: bytes  # uint8 RGB, height × width × 3, row-major
    height: int  # resized: multiples of the profile's factor
    width: int
    digest: str  # sha256 hex of the size and the pixels

    def grid(self, profile: VisionProfile) -> tuple[int, int, int]:
        """(t, h, w) in patches, as the tower's grid_thw."""
        return 1, self.height // profile.patch_size, self.width // profile.patch_size

    def num_tokens(self, profile: VisionProfile) -> int:
        """Its run of image pad tokens in the prompt."""
        return (self.height // profile.factor) * (self.width // profile.factor)
