"""The gateway's image estimate: each image counts as the tokens a node makes of it, read
from its header, never as its base64; every shape a client sends an image in is found."""

from __future__ import annotations

import base64
import io
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from helexa.errors import HelexaError
from helexa.gateway.budgets import TEMPLATE_MARGIN_TOKENS, estimate_prompt_tokens
from helexa.gateway.edge import check_context, estimate_tokens, message_chars, most_tokens
from helexa.protocol.images import (
    MAX_IMAGE_TOKENS,
    MIN_IMAGE_TOKENS,
    estimate_image_tokens,
    estimate_images,
    image_size,
    image_tokens,
)
from helexa.protocol.wire import CHARS_PER_TOKEN


def b64(fmt: str, size: tuple[int, int], noise: bool = False) -> str:
    buf = io.BytesIO()
    image = Image.effect_noise(size, 64).convert("RGB") if noise else Image.new("RGB", size)
    image.save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


SCREENSHOT = b64("PNG", (1280, 800), noise=True)  # ~3 MB of base64: noise does not compress
SCREENSHOT_TOKENS = image_tokens(800, 1280, 32, 256 * 256, 589_824)


def openai_part(data: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def anthropic_block(data: str) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def test_the_default_bounds_cap_an_image_at_the_towers_576_tokens():
    assert MAX_IMAGE_TOKENS == 576
    assert SCREENSHOT_TOKENS == 18 * 30  # 800x1280 → 576x960 pixels: 18x30 tokens of 32²


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_the_size_is_read_from_the_header_of_each_format(fmt):
    data = b64(fmt, (300, 200))
    assert image_size(f"data:image/{fmt.lower()};base64,{data}") == (200, 300)
    assert image_size(data) == (200, 300)  # a bare payload, as Anthropic sends it


def test_an_unreadable_or_remote_image_counts_as_the_upper_bound():
    assert estimate_image_tokens("https://example.com/cat.png") == MAX_IMAGE_TOKENS
    assert estimate_image_tokens("data:image/png;base64,bm90IGFuIGltYWdl") == MAX_IMAGE_TOKENS
    assert estimate_image_tokens("") == MAX_IMAGE_TOKENS


def test_a_small_image_counts_at_least_the_minimum_pixels():
    assert estimate_image_tokens(b64("PNG", (10, 10))) == 64  # 256² pixels at 32²


def test_each_shape_of_image_part_is_found():
    small = b64("PNG", (64, 64))
    body = {
        "messages": [
            {"role": "user", "content": [openai_part(SCREENSHOT), {"type": "text", "text": "hi"}]},
            {"role": "user", "content": [anthropic_block(small)]},
            {  # Claude Code's Read tool on a picture: an image inside a tool_result
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [anthropic_block(small)],
                    }
                ],
            },
        ],
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": f"data:image/png;base64,{small}"},
                    {"type": "input_image", "file_id": "file-abc"},
                ],
            }
        ],
    }
    found = estimate_images(body)
    assert found.num_images == 5
    assert found.num_tokens == SCREENSHOT_TOKENS + 3 * 64 + MAX_IMAGE_TOKENS
    assert found.num_chars >= len(SCREENSHOT) + 3 * len(small)


def test_a_remote_anthropic_url_source_counts_as_the_upper_bound():
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    assert estimate_images([block]).num_tokens == MAX_IMAGE_TOKENS


def test_the_budget_estimate_counts_a_screenshot_as_its_tokens_not_its_base64():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}]}],
    }
    text_only = estimate_prompt_tokens(json.dumps(body).encode())
    body["messages"][0]["content"].append(openai_part(SCREENSHOT))
    raw = json.dumps(body).encode()
    assert len(raw) > 1_000_000  # as text, 250k+ tokens
    with_image = estimate_prompt_tokens(raw)
    part_overhead = math.ceil(len(json.dumps(openai_part(""))) / CHARS_PER_TOKEN) + 1
    assert SCREENSHOT_TOKENS <= with_image - text_only <= SCREENSHOT_TOKENS + part_overhead
    assert with_image > TEMPLATE_MARGIN_TOKENS


def test_the_budget_estimate_counts_an_anthropic_block_as_its_tokens():
    raw = json.dumps({"messages": [{"role": "user", "content": [anthropic_block(SCREENSHOT)]}]})
    assert estimate_prompt_tokens(raw.encode()) < SCREENSHOT_TOKENS + TEMPLATE_MARGIN_TOKENS + 40


def test_the_edge_estimate_adds_image_tokens_and_never_counts_base64_as_text():
    body = {"messages": [{"role": "user", "content": [openai_part(SCREENSHOT)]}]}
    assert message_chars(body) == 0
    assert estimate_tokens(body) == SCREENSHOT_TOKENS


def test_the_edge_counts_an_unreadable_image_as_the_fewest_tokens_an_image_can_be():
    """So a remote URL or a broken image reaches the node, whose 400 says what is wrong."""
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    assert estimate_tokens({"input": [{"role": "user", "content": [image]}]}) == MIN_IMAGE_TOKENS
    assert MIN_IMAGE_TOKENS == 64


_SMALL_PNG = b64("PNG", (64, 64))
_IMAGES = st.sampled_from(
    [
        openai_part(_SMALL_PNG),
        openai_part(b64("PNG", (3000, 2000))),  # at the most tokens an image can be
        anthropic_block(_SMALL_PNG),
        {"type": "input_image", "image_url": "https://example.com/a.png"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/b.png"}},
    ]
)
_TEXT_PARTS = st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=300))
_CONTENT = st.one_of(
    st.text(max_size=2000),
    st.lists(st.one_of(_TEXT_PARTS, _IMAGES), max_size=6),
    st.lists(  # Claude Code's tool results, images inside
        st.builds(
            lambda parts: {"type": "tool_result", "tool_use_id": "t", "content": parts},
            st.lists(st.one_of(_TEXT_PARTS, _IMAGES), max_size=3),
        ),
        max_size=2,
    ),
)
_BODIES = st.builds(
    lambda key, messages: {"model": "m", key: messages},
    st.sampled_from(["messages", "input"]),
    st.lists(st.builds(lambda c: {"role": "user", "content": c}, _CONTENT), max_size=5),
)


@settings(max_examples=150, deadline=None)
@given(body=_BODIES, ascii_only=st.booleans(), slack=st.integers(-3, 3))
def test_the_bound_read_off_the_bytes_never_lets_an_overage_past_the_edge(body, ascii_only, slack):
    """The edge skips its walk over a body whose bytes show it cannot pass the context; the
    bound is never under the estimate, so the check refuses exactly what the walk refuses."""
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    estimate = estimate_tokens(body)
    bound = most_tokens(raw)
    assert bound is None or estimate <= bound
    context = max(1, estimate + slack)

    def refused(*args) -> bool:
        try:
            check_context(*args)
        except HelexaError:
            return True
        return False

    assert refused(body, context, raw) == refused(body, context) == (estimate > context)


def test_a_small_body_of_many_images_is_still_walked_and_refused():
    body = {"messages": [{"role": "user", "content": [openai_part(_SMALL_PNG)] * 20}]}
    raw = json.dumps(body).encode()
    assert estimate_tokens(body) == 20 * 64
    with pytest.raises(HelexaError) as e:
        check_context(body, 20 * 64 - 1, raw)
    assert e.value.code == "context_length_exceeded"
    check_context(body, 20 * 64, raw)
