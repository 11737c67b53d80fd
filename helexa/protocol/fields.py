"""Typed readers of decoded JSON request fields, shared by the wire formats. No I/O.

Each failure is the 400 `invalid_request_error` whose `param` is the field path
(`prefix` + key, e.g. `messages[2].content`) and whose message says what was expected and
what came instead.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from helexa.errors import invalid_request


def fail(path: str, expected: str, got: object) -> NoReturn:
    raise invalid_request(f"{path}: expected {expected}, got {describe(got)}", path)


def describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int | float | str):
        text = repr(value)
        kind = "string" if isinstance(value, str) else "number"
        return f"{kind} {text[:40] + '...' if len(text) > 40 else text}"
    return {list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def object_value(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail(path, "an object", value)
    return value


def string(d: dict[str, Any], key: str, *, required: bool = False, prefix: str = "") -> str | None:
    value = d.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        fail(prefix + key, "a string", value)
    return value


def boolean(d: dict[str, Any], key: str, default: bool = False, prefix: str = "") -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        fail(prefix + key, "a boolean", value)
    return value


def int_value(value: object, path: str, low: int | None = None, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        fail(path, "an integer", value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
        fail(path, f"an integer in {bounds}", value)
    return value


def integer(
    d: dict[str, Any],
    key: str,
    *,
    required: bool = False,
    low: int | None = None,
    high: int | None = None,
    prefix: str = "",
) -> int | None:
    value = d.get(key)
    if value is None and not required:
        return None
    return int_value(value, prefix + key, low, high)


def number(d: dict[str, Any], key: str) -> float | None:
    """A finite number, as a float."""
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        fail(key, "a number", value)
    try:
        result = float(value)
    except OverflowError:
        fail(key, "a finite number", value)
    if not math.isfinite(result):
        fail(key, "a finite number", value)
    return result


def array(d: dict[str, Any], key: str, prefix: str = "", *, required: bool = False) -> list | None:
    value = d.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, list):
        fail(prefix + key, "an array", value)
    return value


def mapping(d: dict[str, Any], key: str, prefix: str = "") -> dict[str, Any] | None:
    value = d.get(key)
    return None if value is None else object_value(value, prefix + key)
