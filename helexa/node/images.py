"""The images of a chat request, read, checked and resized for a vision model.

Every bound is checked before the step it protects: the count before any image is read,
the bytes before (data: URLs) or while (fetched URLs) they arrive, the pixel count from the
image's header before a single pixel is decoded (a decompression bomb is a few KiB on the
wire and gigabytes decoded). Whatever is wrong is a 400 naming the part it is about, never
a crash or an OOM. Runs off the event loop (`prepare_prompt` is called in a thread), so a
fetch from an allow-listed host may block.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from helexa.config import ImageLimits
from helexa.engine.vision.inputs import ImageInput, VisionProfile
from helexa.engine.vision.preprocess import resize_image
from helexa.errors import HelexaError
from helexa.protocol.images import ImageSizeError
from helexa.protocol.openai import ChatCompletionRequest

# media type -> Pillow format: the only decoders an image may reach
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
FORMATS = tuple(MEDIA_TYPES.values())
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One image part's URL, and where it sits in the request (the error's `param`)."""

    url: str
    param: str  # messages[i].content[j].image_url.url


def image_parts(req: ChatCompletionRequest) -> list[ImagePart]:
    """The request's image parts in prompt order: message by message, part by part."""
    return [
        ImagePart(p["image_url"]["url"], f"messages[{i}].content[{j}].image_url.url")
        for i, m in enumerate(req.messages)
        if isinstance(m.content, list)
        for j, p in enumerate(m.content)
        if p.get("type") == "image_url"
    ]


def load_images(
    req: ChatCompletionRequest, profile: VisionProfile, limits: ImageLimits
) -> list[ImageInput]:
    """Each image part decoded and resized for `profile`, in prompt order; a 400 for the
    first one that cannot be (or for too many of them)."""
    parts = image_parts(req)
    if len(parts) > limits.max_images_per_request:
        raise _error(
            f"the request carries {len(parts)} images; this node takes at most "
            f"{limits.max_images_per_request} per request",
            "messages",
            "too_many_images",
        )
    return [load_image(part, profile, limits) for part in parts]


def load_image(part: ImagePart, profile: VisionProfile, limits: ImageLimits) -> ImageInput:
    """One image part: its bytes read, its first frame decoded within bounds, resized."""
    image = decode_image(read_image_bytes(part, limits), part, limits)
    try:
        return resize_image(image, profile)
    except ImageSizeError as e:
        raise _error(str(e), part.param, "invalid_image") from None


def read_image_bytes(part: ImagePart, limits: ImageLimits) -> bytes:
    """The encoded image: a base64 `data:` URL decoded, or an allow-listed http(s) URL
    fetched; any other URL is refused."""
    scheme = part.url.split(":", 1)[0].lower() if ":" in part.url else ""
    if scheme == "data":
        return _data_url_bytes(part, limits)
    if scheme in ("http", "https"):
        return _fetched_bytes(part, limits)
    raise _error(
        f"image URL scheme {scheme or part.url[:20]!r} is not supported: send the image as a "
        "base64 data: URL (data:image/png;base64,...)",
        part.param,
        "invalid_image",
    )


def decode_image(data: bytes, part: ImagePart, limits: ImageLimits) -> Image.Image:
    """The image's first frame, decoded only once its header's size is within bounds.
    Sets nothing process-wide: Pillow's own bomb check (at twice its MAX_IMAGE_PIXELS)
    stays as a backstop, and is a 400 too."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise _error(
                f"the image is {width}x{height} = {width * height} pixels decoded; this node "
                f"takes at most {limits.max_image_pixels}",
                part.param,
                "image_too_large",
            )
        image.seek(0)  # an animation (GIF, WebP, APNG): its first frame
        image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _error(
            f"the image is too large to decode: {e}", part.param, "image_too_large"
        ) from None
    except UnidentifiedImageError:
        raise _error(
            f"the data is not an image in a supported format ({', '.join(MEDIA_TYPES)})",
            part.param,
            "invalid_image",
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated, corrupt
        raise _error(f"the image cannot be decoded: {e}", part.param, "invalid_image") from None
    return image


def _data_url_bytes(part: ImagePart, limits: ImageLimits) -> bytes:
    header, sep, payload = part.url.partition(",")
    media_type, *params = header.removeprefix("data:").split(";")
    media_type = media_type.strip().lower()
    if not sep or "base64" not in params:
        raise _error(
            "an image data: URL must be base64: data:<media type>;base64,<data>",
            part.param,
            "invalid_image",
        )
    if media_type not in MEDIA_TYPES:
        raise _error(
            f"image media type {media_type or '(none)'!r} is not supported; supported: "
            f"{', '.join(MEDIA_TYPES)}",
            part.param,
            "invalid_image",
        )
    if len(payload) // 4 * 3 > limits.max_image_bytes + 3:  # judged before decoding it
        raise _too_many_bytes(part, limits)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _error(
            "the image data: URL's base64 is invalid", part.param, "invalid_image"
        ) from None
    if len(data) > limits.max_image_bytes:
        raise _too_many_bytes(part, limits)
    return data


def _fetched_bytes(part: ImagePart, limits: ImageLimits) -> bytes:
    """GET an allow-listed URL: no redirects (they could lead off the list), the byte limit
    enforced as the body streams in, the whole fetch within the timeout."""
    host = (urlsplit(part.url).hostname or "").lower()
    if not _is_allowed(host, limits.allowed_url_hosts):
        raise _error(
            f"this node does not fetch remote images (host {host!r}): send the image inline "
            "as a base64 data: URL, or the node's operator can allow the host with [node.images] "
            'allowed_url_hosts = ["<host>"] in helexa.toml',
            part.param,
            "image_url_not_allowed",
        )
    timeout = limits.url_fetch_timeout_s
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    num_bytes = 0
    try:
        with (
            httpx.Client(timeout=timeout, follow_redirects=False) as client,
            client.stream("GET", part.url) as resp,
        ):
            if resp.status_code != 200:
                raise _fetch_failed(part, f"it answered HTTP {resp.status_code}")
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_image_bytes:
                raise _too_many_bytes(part, limits)
            for chunk in resp.iter_bytes():
                num_bytes += len(chunk)
                if num_bytes > limits.max_image_bytes:
                    raise _too_many_bytes(part, limits)
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the fetch took too long")
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise _fetch_failed(part, f"it did not answer within {timeout:g} s") from None
    except httpx.HTTPError as e:
        raise _fetch_failed(part, f"{type(e).__name__}: {e}") from None
    return b"".join(chunks)


def _is_allowed(host: str, allowed: Sequence[str]) -> bool:
    return bool(host) and host in {h.strip("[]").lower() for h in allowed}


def _too_many_bytes(part: ImagePart, limits: ImageLimits) -> HelexaError:
    return _error(
        f"the image is larger than this node's limit of {limits.max_image_bytes} bytes "
        f"({limits.max_image_bytes / MiB:g} MiB)",
        part.param,
        "image_too_large",
    )


def _fetch_failed(part: ImagePart, why: str) -> HelexaError:
    return _error(f"fetching the image URL failed: {why}", part.param, "image_fetch_failed")


def _error(message: str, param: str, code: str) -> HelexaError:
    return HelexaError(400, "invalid_request_error", message, param=param, code=code)


def expand_image_pads(
    ids: list[int], images: Sequence[ImageInput], profile: VisionProfile, param: str
) -> list[int]:
    """`ids` with the k-th image placeholder token widened to the k-th image's run of
    `image.num_tokens(profile)` pads, the run the tower's output replaces. A count of
    placeholders that differs from the images' (a template that dropped an image, or text
    that spells the placeholder itself) is a 400: the engine could only misplace them."""
    pad = profile.image_token_id
    num_pads = ids.count(pad)
    if num_pads != len(images):
        raise _error(
            f"the rendered prompt holds {num_pads} image placeholders (token id {pad}) for "
            f"{len(images)} images: the chat template dropped an image, or the text itself "
            "contains the image placeholder token",
            param,
            "image_placeholder_mismatch",
        )
    if not images:
        return ids
    out: list[int] = []
    k = 0
    for t in ids:
        if t == pad:
            out.extend([pad] * images[k].num_tokens(profile))
            k += 1
        else:
            out.append(t)
    return out
