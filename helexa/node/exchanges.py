"""Final usage by exchange id: what a request cost, asked for after it ended.

The gateway names each request it proxies (`x-helexa-exchange`). When its client leaves
a stream part-way, the gateway has seen only the tokens the node had sent; the node knows
what its engine generated. Each named request's final usage is kept here once it has
ended, however it ended, for the gateway's `GET /v1/exchanges/{id}/usage`. The book keeps
the latest `MAX_EXCHANGES` ids; older ones are forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from helexa.errors import HelexaError, invalid_request
from helexa.protocol.wire import EXCHANGE_HEADER, is_exchange_id

MAX_EXCHANGES = 10_000
MAX_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Usage:
    """What one request spent. All zero when the engine never ran it (refused, or left
    while it waited): a request cut during its prefill spent the prompt tokens the engine
    had computed, one that produced a token its whole prompt."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # read from the prefix cache
    cache_write_tokens: int = 0  # computed and stored in it for later requests
    reasoning_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "reasoning_tokens": self.reasoning_tokens,
        }


NOTHING_RAN = Usage()


class Exchange:
    """One named request: running until `end` records its usage (once; later calls are
    no-ops, so whoever ends it first says what it cost), or, once `settle_later` was
    called, until the function it returns does."""

    __slots__ = ("_ended", "_settling", "id", "usage")

    def __init__(self, exchange_id: str) -> None:
        self.id = exchange_id
        self.usage: Usage | None = None
        self._ended = asyncio.Event()
        self._settling = False

    @property
    def is_ended(self) -> bool:
        return self.usage is not None

    def end(self, usage: Usage) -> None:
        if self.usage is None and not self._settling:
            self._record(usage)

    def settle_later(self) -> Callable[[Usage], None]:
        """For a request whose run has ended while what it spent is still being counted
        (the engine's final report on a cut request is on its way): it stays running, and
        `end` a no-op, until the returned function records the count."""
        self._settling = True

        def settle(usage: Usage) -> None:
            if self.usage is None:
                self._record(usage)

        return settle

    def _record(self, usage: Usage) -> None:
        self.usage = usage
        self._ended.set()

    async def wait(self, timeout_s: float) -> bool:
        """Whether it has ended, waiting up to `timeout_s` for it to."""
        if not self.is_ended and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._ended.wait()
        return self.is_ended


class Exchanges:
    """The book of named requests, newest last, bounded at `capacity`."""

    def __init__(self, capacity: int = MAX_EXCHANGES) -> None:
        assert capacity > 0, capacity
        self.capacity = capacity
        self._book: OrderedDict[str, Exchange] = OrderedDict()

    def __len__(self) -> int:
        return len(self._book)

    def begin(self, exchange_id: str) -> Exchange:
        """A new running exchange under `exchange_id` (the 400 naming the header when it is
        not a valid id). An id used again names the newer request from then on."""
        if not is_exchange_id(exchange_id):
            raise invalid_request(
                f"{EXCHANGE_HEADER}: expected 1-64 characters of [A-Za-z0-9_-], "
                f"got {exchange_id[:80]!r}",
                EXCHANGE_HEADER,
            )
        exchange = Exchange(exchange_id)
        self._book.pop(exchange_id, None)
        self._book[exchange_id] = exchange
        while len(self._book) > self.capacity:
            self._book.popitem(last=False)
        return exchange

    def get(self, exchange_id: str) -> Exchange | None:
        return self._book.get(exchange_id)

    async def final_usage(self, exchange_id: str, wait_s: float = 0.0) -> dict[str, Any]:
        """`{"exchange", "usage"}` once the request has ended, waiting up to `wait_s` for it:
        404 `exchange_not_found` for an id not in the book, 409 `exchange_running` when it
        is still running after the wait, 400 for an id that cannot be one."""
        if not is_exchange_id(exchange_id):
            raise invalid_request(
                f"exchange id: expected 1-64 characters of [A-Za-z0-9_-], got {exchange_id[:80]!r}",
                "exchange_id",
            )
        exchange = self._book.get(exchange_id)
        if exchange is None:
            raise HelexaError(
                404,
                "invalid_request_error",
                f"no exchange {exchange_id!r} on this node (unknown, or one of more than "
                f"{self.capacity} since)",
                code="exchange_not_found",
                param="exchange_id",
            )
        if not await exchange.wait(min(wait_s, MAX_WAIT_S)):
            raise HelexaError(
                409,
                "invalid_request_error",
                f"exchange {exchange_id!r} is still running; ask again with wait_s",
                code="exchange_running",
                param="exchange_id",
            )
        assert exchange.usage is not None
        return {"exchange": exchange_id, "usage": exchange.usage.to_dict()}


def parse_wait_s(raw: str | None) -> float:
    """The `wait_s` query parameter: seconds, default 0, at most `MAX_WAIT_S` (a larger
    value is clamped); anything but a finite non-negative number is the 400 naming it."""
    if raw is None or raw == "":
        return 0.0
    try:
        wait_s = float(raw)
    except ValueError:
        wait_s = math.nan
    if not math.isfinite(wait_s) or wait_s < 0:
        raise invalid_request(
            f"wait_s: expected seconds from 0 to {MAX_WAIT_S:g}, got {raw!r}", "wait_s"
        )
    return min(wait_s, MAX_WAIT_S)
