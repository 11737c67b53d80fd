"""Images of a chat request on the node: decoded within bounds or refused with a 400 that
names the part, fetched only from allow-listed hosts, and spliced into the prompt as each
image's run of pad tokens through the real Qwen3.5 template and a Qwen tokenizer."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from helexa.config import ImageLimits
from helexa.engine.tokenizer import load_hf_tokenizer
from helexa.engine.vision.inputs import VisionProfile
from helexa.errors import HelexaError
from helexa.node.admission import Admission, AdmissionLimits
from helexa.node.generation import render_prompt
from helexa.node.images import image_parts, load_images
from helexa.node.served import ServedModel
from helexa.protocol.openai import parse_chat_request
from tests.shared_fixtures import FIXTURE_MODELS, need_shared

IMAGE_PAD, VISION_START, VISION_END = 151655, 151652, 151653
PROFILE = VisionProfile.from_configs(
    {
        "vision_config": {},
        "image_token_id": IMAGE_PAD,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
    },
    None,
)


def encoded(fmt: str, size: tuple[int, int] = (64, 48), color: Any = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(*urls: str, text: str = "What is in the picture?") -> Any:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": text})
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": parts}]})


def refused(*urls: str, limits: ImageLimits | None = None) -> HelexaError:
    with pytest.raises(HelexaError) as e:
        load_images(chat(*urls), PROFILE, limits or ImageLimits())
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG whose header claims width × height pixels, with one tiny IDAT: a few
    dozen bytes on the wire, gigabytes if anything decoded it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


# -- decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "media_type"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")],
)
def test_each_supported_format_decodes_and_is_resized_to_the_profile(fmt, media_type):
    [image] = load_images(chat(data_url(encoded(fmt), media_type)), PROFILE, ImageLimits())
    assert (image.height, image.width) == PROFILE.resized(48, 64)
    assert len(image.rgb) == image.height * image.width * 3
    assert image.num_tokens(PROFILE) == PROFILE.num_tokens(48, 64)


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (64, 64), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    [image] = load_images(chat(data_url(buf.getvalue(), "image/gif")), PROFILE, ImageLimits())
    red, _, blue = image.rgb[:3]
    assert red > 200 and blue < 50  # red, the first frame, not blue


def test_images_come_in_prompt_order_with_their_own_sizes():
    wide, tall = data_url(encoded("PNG", (640, 320))), data_url(encoded("PNG", (320, 640)))
    req = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": wide}}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": tall}}]},
            ],
        }
    )
    assert [p.param for p in image_parts(req)] == [
        "messages[0].content[0].image_url.url",
        "messages[2].content[0].image_url.url",
    ]
    first, second = load_images(req, PROFILE, ImageLimits())
    assert first.width > first.height and second.height > second.width


def test_bad_base64_is_an_invalid_image_naming_the_part():
    e = refused("data:image/png;base64,iVBORw0K!!!not-base64")
    assert e.code == "invalid_image" and "base64" in e.message
    assert e.param == "messages[0].content[0].image_url.url"


def test_an_unsupported_media_type_is_refused_with_the_supported_ones():
    e = refused(data_url(encoded("BMP"), "image/bmp"))
    assert e.code == "invalid_image" and "image/bmp" in e.message and "image/webp" in e.message


def test_bytes_that_are_no_image_are_refused():
    e = refused(data_url(b"hello, I am text", "image/png"))
    assert e.code == "invalid_image"


def test_a_data_url_without_base64_is_refused():
    assert refused("data:image/png,rawbytes").code == "invalid_image"


def test_more_images_than_the_limit_is_too_many_images():
    url = data_url(encoded("PNG"))
    e = refused(url, url, url, limits=ImageLimits(max_images_per_request=2))
    assert e.code == "too_many_images" and "3 images" in e.message and "2" in e.message


def test_an_image_over_the_byte_limit_is_refused_before_decoding():
    data = encoded("PNG", (256, 256), None)  # noise would be larger; any > 100 bytes will do
    e = refused(data_url(data), limits=ImageLimits(max_image_bytes=100))
    assert e.code == "image_too_large" and "100 bytes" in e.message


def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch):
    bomb = png_claiming(100_000, 100_000)
    assert len(bomb) < 100
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self))
    e = refused(data_url(bomb))
    assert e.code == "image_too_large" and loads == []


def test_an_image_over_the_configured_pixels_is_refused_before_decoding(monkeypatch):
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self))
    e = refused(data_url(png_claiming(4000, 3000)), limits=ImageLimits(max_image_pixels=10**6))
    assert e.code == "image_too_large" and "4000x3000" in e.message and loads == []


def test_an_image_more_elongated_than_200_to_1_is_refused():
    e = refused(data_url(encoded("PNG", (3000, 10))))
    assert e.code == "invalid_image" and "200:1" in e.message


def test_other_url_schemes_are_refused():
    assert refused("file:///etc/passwd").code == "invalid_image"


# -- remote URLs ---------------------------------------------------------------------------


class _Images(BaseHTTPRequestHandler):
    body = encoded("PNG", (80, 40))

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(1.5)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "http://example.com/x.png")
            self.end_headers()
            return
        body = self.body * (100 if self.path == "/big.png" else 1)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/big.png":  # the big one streams without a length
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the node hung up once it had enough
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_remote_url_is_refused_by_default_saying_how_to_allow_it(image_server):
    e = refused(f"{image_server}/ok.png")
    assert e.code == "image_url_not_allowed"
    assert "allowed_url_hosts" in e.message and "data:" in e.message


def test_an_allow_listed_host_is_fetched(image_server):
    limits = ImageLimits(allowed_url_hosts=["127.0.0.1"])
    [image] = load_images(chat(f"{image_server}/ok.png"), PROFILE, limits)
    assert (image.height, image.width) == PROFILE.resized(40, 80)


def test_a_fetch_over_the_byte_limit_is_cut(image_server):
    limits = ImageLimits(allowed_url_hosts=["127.0.0.1"], max_image_bytes=len(_Images.body) * 3)
    assert refused(f"{image_server}/big.png", limits=limits).code == "image_too_large"


def test_a_fetch_past_the_timeout_is_refused(image_server):
    limits = ImageLimits(allowed_url_hosts=["127.0.0.1"], url_fetch_timeout_s=0.3)
    t0 = time.monotonic()
    e = refused(f"{image_server}/slow.png", limits=limits)
    assert e.code == "image_fetch_failed" and "0.3 s" in e.message
    assert time.monotonic() - t0 < 1.2


def test_a_redirect_is_not_followed(image_server):
    limits = ImageLimits(allowed_url_hosts=["127.0.0.1"])
    e = refused(f"{image_server}/moved.png", limits=limits)
    assert e.code == "image_fetch_failed" and "302" in e.message


# -- the prompt ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_tokenizer():
    models = need_shared(FIXTURE_MODELS)
    tok = load_hf_tokenizer(models / "Qwen3-0.6B")
    template = (models / "Qwen3.5-4B" / "Qwen3.5-4B.jinja").read_text(encoding="utf-8")
    return dataclasses.replace(tok, chat_template=template)


def served_model(tokenizer: Any, vision: VisionProfile | None) -> ServedModel:
    facts = SimpleNamespace(
        memory_mb=1, vision=vision, vocab_size=tokenizer.vocab_size, max_model_len=32768
    )
    llm: Any = SimpleNamespace(facts=facts, tokenizer=tokenizer)
    return ServedModel("m", None, llm, Admission(AdmissionLimits(1, 1, 1.0, 0)))  # type: ignore[arg-type]


def test_each_placeholder_becomes_its_images_run_of_pads(qwen_tokenizer):
    small, wide = encoded("PNG", (64, 48)), encoded("PNG", (1200, 600))
    served = served_model(qwen_tokenizer, PROFILE)
    assert served.capabilities == ["text", "image"]
    prompt = render_prompt(served, chat(data_url(small), data_url(wide)))
    ids = prompt.ids
    runs = []
    for i, t in enumerate(ids):
        if t == VISION_START:
            end = ids.index(VISION_END, i)
            runs.append(ids[i + 1 : end])
    sizes = [PROFILE.num_tokens(48, 64), PROFILE.num_tokens(600, 1200)]
    assert [len(r) for r in runs] == sizes and sizes[0] != sizes[1]
    assert all(set(r) == {IMAGE_PAD} for r in runs)
    assert [im.num_tokens(PROFILE) for im in prompt.images] == sizes
    text_only = render_prompt(served, chat(text="What is in the picture?"))
    assert len(ids) == len(text_only.ids) + sum(sizes) + 2 * 2  # start/end around each


def test_the_node_pixel_bounds_shape_the_runs(qwen_tokenizer):
    served = served_model(qwen_tokenizer, PROFILE)
    served.image_limits = ImageLimits(min_pixels=64 * 64, max_pixels=128 * 128)
    assert served.vision is not None and served.vision.max_pixels == 128 * 128
    prompt = render_prompt(served, chat(data_url(encoded("PNG", (1200, 600)))))
    assert prompt.ids.count(IMAGE_PAD) <= 16  # 128² pixels at 32² a token


def test_text_that_spells_the_placeholder_is_refused(qwen_tokenizer):
    served = served_model(qwen_tokenizer, PROFILE)
    req = chat(data_url(encoded("PNG")), text="and <|image_pad|> here")
    with pytest.raises(HelexaError) as e:
        render_prompt(served, req)
    assert e.value.status == 400 and e.value.code == "image_placeholder_mismatch"


def test_a_text_only_model_keeps_refusing_images(qwen_tokenizer):
    served = served_model(qwen_tokenizer, None)
    assert served.capabilities == ["text"]
    with pytest.raises(HelexaError) as e:
        render_prompt(served, chat(data_url(encoded("PNG"))))
    assert e.value.code == "vision_unsupported"
