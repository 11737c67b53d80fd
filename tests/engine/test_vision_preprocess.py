"""Images into patches: `patches(resize_image(img))` is transformers' Qwen2VLImageProcessorPil
output for every kind of image a request may carry, and no image ever exceeds the tower's
learned position grid."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from helexa.engine.vision.inputs import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, VisionProfile
from helexa.engine.vision.preprocess import patches, resize_image
from helexa.protocol.images import ImageSizeError

Qwen2VLImageProcessorPil = pytest.importorskip(
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
).Qwen2VLImageProcessorPil

HALF = [0.5, 0.5, 0.5]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # per channel: catches a channel mix-up
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _profile(mean=HALF, std=HALF, *, min_pixels=128 * 128, max_pixels=512 * 512, num_pos=2304):
    vision = {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}
    vision["num_position_embeddings"] = num_pos
    pre = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
    pre |= {"image_mean": mean, "image_std": std}
    return VisionProfile.from_configs(
        {"vision_config": vision}, pre, min_pixels=min_pixels, max_pixels=max_pixels
    )


def _noise(mode: str, width: int, height: int, seed: int = 0) -> Image.Image:
    """Random pixels with a gradient under them: resampling errors cannot hide in flat areas."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 200, width, dtype=np.float64)[None, :, None]
    rgba = rng.integers(0, 56, (height, width, 4)) + ramp
    rgba[..., 3] = rng.integers(0, 256, (height, width))  # partial transparency everywhere
    image = Image.fromarray(rgba.astype(np.uint8), "RGBA")
    if mode == "P":
        return image.convert("RGB").quantize(colors=64)
    if mode == "P+transparency":  # GIF-like: one palette entry is transparent
        paletted = image.convert("RGB").quantize(colors=64)
        paletted.info["transparency"] = 3
        return paletted
    return image if mode == "RGBA" else image.convert(mode)


IMAGES = [
    ("RGB", 640, 480),
    ("RGBA", 300, 200),
    ("P", 211, 37),
    ("P+transparency", 120, 90),
    ("L", 37, 211),
    ("RGB", 1000, 300),
    ("RGB", 10, 10),  # min_pixels enlarges it
    ("RGB", 1600, 1200),  # max_pixels shrinks it
    ("RGBA", 512, 512),  # already the size: no resize
]


def _reference(image: Image.Image, profile: VisionProfile, mean, std):
    processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=mean,
        image_std=std,
        min_pixels=profile.min_pixels,
        max_pixels=profile.max_pixels,
    )
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize(("mode", "width", "height"), IMAGES)
def test_patches_of_a_resized_image_are_the_reference_processors(mode, width, height):
    profile = _profile()
    image = _noise(mode, width, height)
    resized = resize_image(image, profile)
    pixels, grid = _reference(image, profile, HALF, HALF)
    ours = patches(resized, profile)
    assert ours.dtype == torch.float32
    assert ours.shape == pixels.shape
    torch.testing.assert_close(ours, pixels.to(torch.float32), atol=1e-6, rtol=0)
    assert tuple(grid[0].tolist()) == resized.grid(profile)


def test_patches_normalise_each_channel_by_its_own_mean_and_std():
    profile = _profile(CLIP_MEAN, CLIP_STD)
    image = _noise("RGB", 333, 155, seed=1)
    pixels, grid = _reference(image, profile, CLIP_MEAN, CLIP_STD)
    resized = resize_image(image, profile)
    torch.testing.assert_close(patches(resized, profile), pixels, atol=1e-6, rtol=0)
    assert tuple(grid[0].tolist()) == resized.grid(profile)


def test_resize_image_is_the_reference_resize_bit_for_bit():
    """With no rescale and no normalisation the patches are the resized bytes themselves."""
    profile = _raw(_profile())
    image = _noise("RGBA", 777, 333, seed=2)
    processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        do_rescale=False,
        do_normalize=False,
        min_pixels=profile.min_pixels,
        max_pixels=profile.max_pixels,
    )
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    assert torch.equal(patches(resize_image(image, profile), profile), pixels)


def _raw(profile: VisionProfile) -> VisionProfile:
    return msgspec.structs.replace(profile, do_rescale=False, do_normalize=False)


def test_patch_rows_are_merge_blocks_of_the_image():
    """A row is one 16×16 patch, channel-major, its frame repeated in time; rows run over 2×2
    merge blocks, block-row by block-row."""
    profile = _profile(min_pixels=32 * 32, max_pixels=64 * 64)
    rgb = np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)
    resized = resize_image(Image.fromarray(rgb, "RGB"), profile)
    assert (resized.height, resized.width) == (64, 64)
    rows = patches(resized, _raw(profile)).view(16, 3, 2, 16, 16)
    # The third row is the first block's bottom-left patch: pixels [16:32, 0:16].
    expected = torch.from_numpy(rgb[16:32, 0:16]).permute(2, 0, 1).to(torch.float32)
    assert torch.equal(rows[2, :, 0], expected) and torch.equal(rows[2, :, 1], expected)
    # The fifth row starts the second block: pixels [0:16, 32:48].
    expected = torch.from_numpy(rgb[0:16, 32:48]).permute(2, 0, 1).to(torch.float32)
    assert torch.equal(rows[4, :, 0], expected)


@pytest.mark.parametrize(
    ("width", "height"),
    [
        (808, 1600),
        (1600, 808),
        (10000, 60),
        (60, 10000),
        (4000, 4000),
        (20000, 100),
        (100, 20000),
        (1, 200),
        (200, 1),
        (4096, 2160),
        (33, 33),
        (1, 1),
    ],
)
def test_no_image_exceeds_the_towers_position_grid(width, height):
    profile = _profile(min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS)
    assert profile.max_patches == 2304
    t, h, w = resize_image(Image.new("RGB", (width, height)), profile).grid(profile)
    assert t * h * w <= 2304


@pytest.mark.parametrize(("width", "height"), [(10050, 50), (50, 10050), (201, 1)])
def test_an_image_more_elongated_than_200_to_1_is_refused(width, height):
    profile = _profile(min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS)
    with pytest.raises(ImageSizeError):
        resize_image(Image.new("RGB", (width, height)), profile)
