"""The OpenAI error envelope, used by both roles (docs/node.md and docs/gateway.md)."""

from __future__ import annotations

import math
from typing import Any


class HelexaError(Exception):
    """An error a client sees: HTTP status, OpenAI `type`/`code`/`param`, and maybe Retry-After."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.extra = dict(extra or {})
        self.extra_headers: dict[str, str] = {}

    def to_envelope(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "code", "param", **extra}}`."""
        body = {"message": self.message, "type": self.type, "code": self.code, "param": self.param}
        return {"error": {**body, **self.extra}}

    def headers(self) -> dict[str, str]:
        """Response headers: Retry-After in whole seconds, rounded up, when set, plus any
        `extra_headers` (advisory ones; never part of the envelope)."""
        headers = dict(self.extra_headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(0, math.ceil(self.retry_after)))
        return headers

    def __repr__(self) -> str:
        return f"HelexaError({self.status}, {self.type!r}, {self.message!r}, code={self.code!r})"


_INVALID = "invalid_request_error"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> HelexaError:
    """400: the request is malformed; `param` names the offending field path."""
    return HelexaError(400, _INVALID, message, code=code, param=param)


def model_not_found(model: str) -> HelexaError:
    return HelexaError(
        404,
        _INVALID,
        f"The model {model!r} does not exist or is not loaded",
        code="model_not_found",
        param="model",
    )


def context_length_exceeded(max_len: int, num_tokens: int | None = None) -> HelexaError:
    message = f"This model's maximum context length is {max_len} tokens"
    if num_tokens is not None:
        message += f"; the prompt has {num_tokens} tokens"
    message += ". Please reduce the length of the messages."
    return HelexaError(400, _INVALID, message, code="context_length_exceeded", param="messages")


def vision_unsupported(model: str) -> HelexaError:
    return HelexaError(
        400,
        _INVALID,
        f"The model {model!r} does not accept image input",
        code="vision_unsupported",
        param="messages",
    )


def template_render_failed(detail: str) -> HelexaError:
    return HelexaError(
        422,
        _INVALID,
        f"The chat template failed to render: {detail}",
        code="template_render_failed",
    )


def tool_choice_not_satisfied(forced: str, called: set[str], said: str) -> HelexaError:
    """The model answered without the tool call `tool_choice` demanded ("*": any tool)."""
    wanted = "a tool call" if forced == "*" else f"a call to {forced!r}"
    got = f"calls to {sorted(called)}" if called else f"text: {said[:200]!r}"
    return HelexaError(
        422,
        _INVALID,
        f"tool_choice demanded {wanted}, but the model answered with {got}; retry, or let "
        "tool_choice be 'auto'",
        code="tool_choice_not_satisfied",
        param="tool_choice",
    )


def chained_conversation_not_supported() -> HelexaError:
    return HelexaError(
        400,
        _INVALID,
        "previous_response_id is not supported: send the whole conversation as input",
        code="chained_conversation_not_supported",
        param="previous_response_id",
    )


def invalid_api_key(message: str = "Invalid API key") -> HelexaError:
    return HelexaError(401, "authentication_error", message, code="invalid_api_key")


def insufficient_quota(message: str) -> HelexaError:
    return HelexaError(429, "insufficient_quota", message, code="insufficient_quota")


def rate_limit_exceeded(message: str, retry_after: float, *, status: int = 429) -> HelexaError:
    """429 for a principal's cap or rolling budget, 503 for a full queue; always Retry-After."""
    assert status in (429, 503), status
    return HelexaError(
        status, "rate_limit_error", message, code="rate_limit_exceeded", retry_after=retry_after
    )


def service_unavailable(
    message: str, retry_after: float, *, code: str = "service_unavailable"
) -> HelexaError:
    """503 with Retry-After; `code` may be e.g. "recovering" for a model coming back."""
    return HelexaError(503, "service_unavailable", message, code=code, retry_after=retry_after)


def insufficient_vram(message: str, retry_after: float) -> HelexaError:
    return service_unavailable(message, retry_after, code="insufficient_vram")
