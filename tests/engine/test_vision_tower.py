"""The vision tower: loaded from a transformers Qwen3_5VisionModel's weights, it gives the
same merged embeddings for one image, for images of different grids side by side, and for a
grid larger than the learned position table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from helexa.engine.vision.inputs import VisionProfile
from helexa.engine.vision.preprocess import patches, resize_image
from helexa.engine.vision.tower import VisionTower

modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
configuration = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5")

VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    num_position_embeddings=64,  # an 8x8 learned grid
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
PATCH_DIM = 3 * 2 * 16 * 16


@pytest.fixture(scope="module")
def pair():
    """(reference, ours): a random HF tower, every weight perturbed so that a norm or bias
    put in the wrong place shows, and a VisionTower loaded from its state_dict."""
    torch.manual_seed(0)
    config = configuration.Qwen3_5VisionConfig(**VISION)
    reference = modeling.Qwen3_5VisionModel(config).float().eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    tower = VisionTower(config.to_dict()).eval()
    state = reference.state_dict()
    assert tower.load_weights(state.items()) == set(state)
    return reference, tower


def _compare(pair, grids):
    reference, tower = pair
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM)
    with torch.no_grad():
        expected = reference(pixels, grid_thw=torch.tensor(grids)).pooler_output
        ours = tower(pixels, grids)
    assert ours.shape == (sum(t * h * w for t, h, w in grids) // 4, VISION["out_hidden_size"])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    return ours


def test_one_image_is_the_references(pair):
    _compare(pair, [(1, 4, 6)])


def test_images_of_different_grids_attend_only_to_themselves(pair):
    both = _compare(pair, [(1, 4, 6), (1, 8, 2)])
    torch.manual_seed(1)
    _compare(pair, [(1, 8, 2), (1, 2, 2), (1, 4, 6)])
    assert both.shape[0] == 6 + 4


def test_a_grid_beyond_the_learned_table_interpolates_it(pair):
    _compare(pair, [(1, 12, 10)])
    _compare(pair, [(1, 2, 16), (1, 14, 2)])


def test_an_unknown_weight_is_refused(pair):
    _, tower = pair
    with pytest.raises(KeyError, match="deepstack"):
        tower.load_weights([("deepstack_merger_list.0.norm.weight", torch.zeros(32))])


def test_encode_splits_the_embeddings_per_image_in_bf16(pair):
    reference, _ = pair
    tower = VisionTower(configuration.Qwen3_5VisionConfig(**VISION).to_dict())
    tower.load_weights(reference.state_dict().items())
    tower = tower.to(torch.bfloat16)
    assert tower.pos_embed.weight.dtype == torch.bfloat16
    profile = VisionProfile.from_configs(
        {"vision_config": VISION}, None, min_pixels=32 * 32, max_pixels=64 * 64 * 4
    )
    rng = np.random.default_rng(0)
    images = [
        resize_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), profile)
        for h, w in [(64, 96), (128, 32)]
    ]
    out = tower.encode(images, profile)
    assert [o.shape for o in out] == [(image.num_tokens(profile), 64) for image in images]
    assert all(o.dtype == torch.bfloat16 and torch.isfinite(o).all() for o in out)
    # bf16 stays near the float32 reference.
    grids = [image.grid(profile) for image in images]
    with torch.no_grad():
        pixels = torch.cat([patches(image, profile) for image in images])
        expected = reference(pixels, grid_thw=torch.tensor(grids)).pooler_output
    torch.testing.assert_close(torch.cat(out).float(), expected, atol=0.15, rtol=0.05)
