"""The OpenAI error envelope and Retry-After header for every kind in SPEC's error table."""

from __future__ import annotations

import pytest

from helexa import errors
from helexa.engine.llm_engine import ContextLengthExceededError
from helexa.errors import HelexaError

# (error, status, type, code, Retry-After header or None)
KINDS: list[tuple[HelexaError, int, str, str | None, str | None]] = [
    (errors.invalid_request("bad", "temperature"), 400, "invalid_request_error", None, None),
    (errors.model_not_found("x"), 404, "invalid_request_error", "model_not_found", None),
    (
        errors.context_length_exceeded(2048, 3000),
        400,
        "invalid_request_error",
        "context_length_exceeded",
        None,
    ),
    (errors.vision_unsupported("x"), 400, "invalid_request_error", "vision_unsupported", None),
    (
        errors.template_render_failed("boom"),
        422,
        "invalid_request_error",
        "template_render_failed",
        None,
    ),
    (
        errors.chained_conversation_not_supported(),
        400,
        "invalid_request_error",
        "chained_conversation_not_supported",
        None,
    ),
    (errors.invalid_api_key(), 401, "authentication_error", "invalid_api_key", None),
    (errors.insufficient_quota("spent"), 429, "insufficient_quota", "insufficient_quota", None),
    (errors.rate_limit_exceeded("cap", 1.2), 429, "rate_limit_error", "rate_limit_exceeded", "2"),
    (
        errors.rate_limit_exceeded("queue full", 3, status=503),
        503,
        "rate_limit_error",
        "rate_limit_exceeded",
        "3",
    ),
    (
        errors.service_unavailable("busy", 0.01),
        503,
        "service_unavailable",
        "service_unavailable",
        "1",
    ),
    (
        errors.service_unavailable("coming back", 5, code="recovering"),
        503,
        "service_unavailable",
        "recovering",
        "5",
    ),
    (
        errors.insufficient_vram("no room", 30),
        503,
        "service_unavailable",
        "insufficient_vram",
        "30",
    ),
]


@pytest.mark.parametrize(
    ("error", "status", "type_", "code", "retry_after"), KINDS, ids=[k[3] or k[2] for k in KINDS]
)
def test_each_kind_has_its_status_envelope_and_retry_after(
    error: HelexaError, status: int, type_: str, code: str | None, retry_after: str | None
) -> None:
    assert error.status == status
    envelope = error.to_envelope()
    assert set(envelope) == {"error"}
    assert envelope["error"] == {
        "message": error.message,
        "type": type_,
        "code": code,
        "param": error.param,
    }
    assert error.message
    expected = {} if retry_after is None else {"Retry-After": retry_after}
    assert error.headers() == expected


def test_context_length_exceeded_says_the_maximum_context_length() -> None:
    error = errors.context_length_exceeded(2048, 3000)
    assert "maximum context length is 2048 tokens" in error.message
    engine_error = ContextLengthExceededError(3000, 2048)
    assert "maximum context length is 2048 tokens" in str(engine_error)


def test_invalid_request_names_its_param_and_extras_join_the_envelope() -> None:
    error = HelexaError(400, "invalid_request_error", "m", param="n", extra={"model": "x"})
    assert error.to_envelope() == {
        "error": {
            "message": "m",
            "type": "invalid_request_error",
            "code": None,
            "param": "n",
            "model": "x",
        }
    }


def test_errors_are_exceptions_carrying_their_message() -> None:
    with pytest.raises(HelexaError, match="spent"):
        raise errors.insufficient_quota("spent")
