"""Logging for both roles: configured once by the CLI; events carry structured fields.

`event(log, level, what, **fields)` writes "what k=v k=v" as text, and with `[log] json`
one JSON object per line whose fields are real keys, so a failure can be found by node,
model or status without parsing prose.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

from helexa.config import LogConfig

_FIELDS = "helexa_fields"


def event(log: logging.Logger, level: int, what: str, **fields: Any) -> None:
    text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items())
    log.log(level, f"{what} {text}" if text else what, extra={_FIELDS: fields})


_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(given: str | None) -> str:
    """The caller's `x-request-id` when it is sane (≤ 128 of [A-Za-z0-9._:-]), else a new
    one: both roles log under it and return it."""
    if given is not None and _SANE_ID.fullmatch(given):
        return given
    return new_id()


def new_id() -> str:
    """128 random bits as 32 hex digits, as `uuid4().hex` gives but without building a UUID
    (ids are made on every request)."""
    return os.urandom(16).hex()


def request_done(
    log: logging.Logger,
    *,
    request_id: str,
    model: str | None,
    status: int,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    finish_reason: str | None = None,
    ttft_ms: float | None = None,
    total_ms: float,
    **extra: Any,
) -> None:
    """The one line each role writes when a request ends (docs/node.md § Security, docs/gateway.md § Request ids)."""
    event(
        log,
        logging.INFO,
        "request",
        request_id=request_id,
        model=model,
        status=status,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        finish_reason=finish_reason,
        ttft_ms=None if ttft_ms is None else round(ttft_ms, 1),
        total_ms=round(total_ms, 1),
        **extra,
    )


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry |= getattr(record, _FIELDS, {})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(cfg: LogConfig) -> None:
    # No format here names the caller's file, thread or process: logging need not look them
    # up for every record (the logging HOWTO's "Optimization"), which each request's line
    # would otherwise pay for.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter()
        if cfg.json
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=cfg.level.upper(), handlers=[handler], force=True)
