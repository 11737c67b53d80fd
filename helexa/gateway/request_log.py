"""The one log line the gateway writes per API request (`helexa.logs.request_done`).

What a request learns is spread over its life: the handler knows the model, the exchange
with the node knows tokens, finish reason and first byte, the HTTP layer knows the status.
A stream's exchange may settle after its response has ended (a client that leaves), or
before: the line is written when the last of them ends, so it always has everything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from helexa.logs import request_done

log = logging.getLogger("helexa.gateway.requests")

RECORD_STATE = "helexa_request"  # its key in the ASGI scope's state


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    started: float = field(default_factory=time.monotonic)
    model: str | None = None
    node: str | None = None
    status: int = 500
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    first_token: float | None = None  # the first generated text (a non-stream: all of it)
    cut: bool = False  # a stream that ended before its node finished
    open_parts: int = 1  # the response, plus each exchange with a node not yet settled
    written: bool = False
    # run when the request is over, whatever its handler did: settle what it left open
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def hold(self) -> None:
        """An exchange with a node began: the line waits for it too."""
        self.open_parts += 1

    def end(self) -> None:
        """The request is over: its cleanups run, then its response part is released."""
        cleanups, self.cleanups = self.cleanups, []
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception:
                log.exception("settling what request %s left open failed", self.request_id)
        self.release()

    def release(self) -> None:
        """The response, or an exchange, ended; the last one writes the line."""
        self.open_parts -= 1
        if self.open_parts <= 0 and not self.written:
            self.written = True
            self.write()

    def write(self) -> None:
        now = time.monotonic()
        extra: dict[str, object] = {"node": self.node} if self.node else {}
        if self.cut:
            extra["cut"] = True
        request_done(
            log,
            request_id=self.request_id,
            model=self.model,
            status=self.status,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            finish_reason=self.finish_reason,
            ttft_ms=None if self.first_token is None else (self.first_token - self.started) * 1000,
            total_ms=(now - self.started) * 1000,
            **extra,
        )
