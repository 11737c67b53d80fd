"""Edge validation: catch a prompt that cannot fit before it costs a node anything, and
advise known clients how to stop sending one (advice is a header only, never behaviour)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from helexa.errors import HelexaError, context_length_exceeded
from helexa.protocol.images import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS, estimate_images
from helexa.protocol.wire import CHARS_PER_TOKEN

# User-Agent fragment (lower case) -> how that client is told the context size.
_ADVICE = {
    "litellm": "litellm: set max_input_tokens: {n} for this model in model_list so it trims first",
    "agent-zero": "Agent Zero: set the chat model's ctx_length to {n} or less",
    "zed": "Zed: set max_tokens: {n} for this model in language_models.openai.available_models",
    "opencode": "opencode: set limit.context to {n} for this model in opencode.json so it compacts in time",
}


_PROMPT_KEYS = ("messages", "prompt", "input", "instructions")


def message_chars(body: Mapping[str, Any]) -> int:
    """Characters of prompt text in a chat, completions or responses body; image parts'
    data is not text (their URLs and base64 sit under keys this never reads)."""

    def text(value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):
            return sum(text(v) for v in value)
        if isinstance(value, dict):
            return sum(text(value.get(k)) for k in ("content", "text", "input", "output"))
        return 0

    return sum(text(body.get(k)) for k in _PROMPT_KEYS)


def estimate_tokens(body: Mapping[str, Any]) -> int:
    """~4 characters a token over the message text, plus each image's tokens as a node
    sizes it by default (the fewest an image can be when its size is unreadable): under-
    counts on purpose, so only gross overages are caught here and the node stays the exact
    wall (and gives its own, better 400 for an image it cannot take)."""
    images = estimate_images([body.get(k) for k in _PROMPT_KEYS], MIN_IMAGE_TOKENS)
    return math.ceil(message_chars(body) / CHARS_PER_TOKEN) + images.num_tokens


def most_tokens(raw: bytes) -> int | None:
    """An upper bound on `estimate_tokens` of the body `raw` encodes, read off its bytes
    (None when it cannot be): each byte a character (JSON takes at least a byte for each
    character it encodes), and each mention of "image" an image of twice the most tokens an
    estimate gives one. A body with a `\\u` escape could spell "image" without the bytes: no
    bound."""
    if b"\\u" in raw:
        return None
    return math.ceil(len(raw) / CHARS_PER_TOKEN) + raw.count(b"image") * 2 * MAX_IMAGE_TOKENS


def check_context(body: Mapping[str, Any], context: int | None, raw: bytes | None = None) -> None:
    """Refuse a prompt whose estimate is over `context`. With the body's bytes (`raw`), a
    prompt that cannot be over it (`most_tokens`) passes without the walk over its parts."""
    if context is None:
        return
    if raw is not None and (bound := most_tokens(raw)) is not None and bound <= context:
        return
    estimate = estimate_tokens(body)
    if estimate > context:
        raise context_length_exceeded(context, estimate)


def advice(user_agent: str | None, error: HelexaError, context: int | None) -> str | None:
    """Client-specific guidance for a context error, or None for other clients/errors."""
    if error.code != "context_length_exceeded" or context is None or not user_agent:
        return None
    agent = user_agent.lower()
    for fragment, text in _ADVICE.items():
        if fragment in agent:
            return text.format(n=context)
    return None
