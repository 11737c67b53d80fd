"""[node.images]: the bounds on images into vision models, as a nested table of [node],
validated like every other key and overridable as HELEXA_NODE_IMAGES_<KEY>."""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from helexa.config import ConfigError, ImageLimits, load_config

EXAMPLE = Path(__file__).resolve().parent.parent / "helexa.toml.example"


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None):
    path = tmp_path / "helexa.toml"
    path.write_text(text)
    return load_config(path, env=env or {})


def test_the_defaults_refuse_remote_urls_and_bound_everything():
    images = load_config(env={}).node.images
    assert images == ImageLimits()
    assert (images.max_images_per_request, images.max_image_bytes) == (16, 20 << 20)
    assert (images.min_pixels, images.max_pixels) == (256 * 256, 1024 * 1024)
    assert images.max_image_pixels == 50_000_000 and images.allowed_url_hosts == []
    assert images.url_fetch_timeout_s == 10.0


def test_the_table_loads(tmp_path):
    text = '[node.images]\nmax_images_per_request = 4\nallowed_url_hosts = ["img.internal"]\n'
    images = load(tmp_path, text).node.images
    assert images.max_images_per_request == 4 and images.allowed_url_hosts == ["img.internal"]


def test_env_overrides_reach_the_nested_table(tmp_path):
    env = {
        "HELEXA_NODE_IMAGES_ALLOWED_URL_HOSTS": "a.example, 10.0.0.2",
        "HELEXA_NODE_IMAGES_MAX_PIXELS": "589824",
    }
    images = load(tmp_path, "[node.images]\nmax_pixels = 4096\n", env).node.images
    assert images.allowed_url_hosts == ["a.example", "10.0.0.2"] and images.max_pixels == 589824


def test_bad_values_are_all_reported_with_their_key(tmp_path):
    text = (
        "[node.images]\nmax_image_bytes = 0\nurl_fetch_timeout_s = -1\n"
        'allowed_url_hosts = ["https://img.example/x"]\nmax_pixel = 5\n'
    )
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    message = str(e.value)
    assert "[node] images.max_image_bytes: expected a positive integer, got 0" in message
    assert "images.url_fetch_timeout_s: expected a positive number" in message
    assert "allowed_url_hosts[0]: expected a host name" in message
    assert "max_pixel: unknown key (did you mean 'max_pixels'?)" in message


def test_an_unknown_env_key_names_the_nested_table():
    with pytest.raises(ConfigError, match=r"\[node.images\] has no key 'max_pixel'"):
        load_config(env={"HELEXA_NODE_IMAGES_MAX_PIXEL": "5"})


def test_min_pixels_above_max_pixels_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="min_pixels: 4096 exceeds max_pixels 1024"):
        load(tmp_path, "[node.images]\nmin_pixels = 4096\nmax_pixels = 1024\n")


def test_the_example_documents_every_images_key():
    text = EXAMPLE.read_text()
    table = text.split("[node.images]", 1)[1].split("\n[", 1)[0]
    documented = set(re.findall(r"(?m)^# ?(\w+) = ", table))
    assert {f.name for f in fields(ImageLimits)} - documented == set()
