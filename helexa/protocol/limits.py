"""Bounds on what one request may ask of a node, checked before any tokenizing, so that no
single request can stall or exhaust a model for everyone (docs/node.md § Security lists
them). Each breach is a 400 naming the field."""

from __future__ import annotations

from helexa.errors import invalid_request
from helexa.protocol.openai import (
    MAX_LOGIT_BIAS,
    MAX_STOP,
    ChatCompletionRequest,
    CompletionRequest,
)
from helexa.protocol.wire import DEFAULT_MAX_OUTPUT_TOKENS

__all__ = ["MAX_LOGIT_BIAS", "MAX_STOP", "check_bounds"]  # the parser checks those two

MAX_STOP_CHARS = 512  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 10_000
MAX_PROMPT_CHARS = 8_000_000  # message text, tool definitions and arguments together
# Non-streaming answers are held whole in memory until the last token.
MAX_BUFFERED_TOKENS = 131_072  # n × max_tokens (absent max_tokens counts as 8192)
MAX_BUFFERED_LOGPROBS = 100  # n × top_logprobs


def check_bounds(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Raise the 400 naming the first field past its bound."""
    for i, s in enumerate(req.stop):
        if len(s) > MAX_STOP_CHARS:
            raise invalid_request(
                f"stop[{i}]: at most {MAX_STOP_CHARS} characters, got {len(s)}", f"stop[{i}]"
            )
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid_request(
            f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(req.stop_token_ids)}",
            "stop_token_ids",
        )
    if not req.stream:
        limit = req.output_limit or DEFAULT_MAX_OUTPUT_TOKENS
        if req.n * limit > MAX_BUFFERED_TOKENS:
            raise invalid_request(
                f"n × max_tokens: at most {MAX_BUFFERED_TOKENS} tokens in one non-streaming "
                f"answer, got {req.n} × {limit}; stream it, or ask for less",
                "max_tokens" if req.n == 1 else "n",
            )
        top = _top_logprobs(req)
        if req.n * top > MAX_BUFFERED_LOGPROBS:
            name = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
            raise invalid_request(
                f"n × {name}: at most {MAX_BUFFERED_LOGPROBS} in one non-streaming answer, "
                f"got {req.n} × {top}; stream it, or ask for less",
                name,
            )
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)
    elif isinstance(req.prompt, str) and len(req.prompt) > MAX_PROMPT_CHARS:
        raise invalid_request(
            f"prompt: at most {MAX_PROMPT_CHARS} characters, got {len(req.prompt)}", "prompt"
        )
    elif isinstance(req.prompt, list) and len(req.prompt) > MAX_PROMPT_CHARS:
        raise invalid_request(
            f"prompt: at most {MAX_PROMPT_CHARS} tokens, got {len(req.prompt)}", "prompt"
        )


def _top_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else 0
    return req.logprobs or 0


def _check_chat(req: ChatCompletionRequest) -> None:
    if len(req.messages) > MAX_MESSAGES:
        raise invalid_request(
            f"messages: at most {MAX_MESSAGES} messages, got {len(req.messages)}", "messages"
        )
    total = 0
    for m in req.messages:
        total += _text_len(m.content) + len(m.reasoning_content or "")
        for call in m.tool_calls or ():
            args = call.arguments
            total += len(args) if isinstance(args, str) else len(str(args))
    for tool in req.tools:
        total += len(tool.description or "") + len(str(tool.parameters or ""))
    if total > MAX_PROMPT_CHARS:
        raise invalid_request(
            f"messages: at most {MAX_PROMPT_CHARS} characters of text in one request, got {total}",
            "messages",
        )


def _text_len(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0
