"""Who is calling (docs/gateway.md § Keys and who is calling): a key looked up by its hash, sent as
`Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic clients),
on every route.

`require_auth = false`: no key or an unknown key is served anonymously (clients send
placeholder keys); a known key is metered. `require_auth = true`: missing or unknown →
401 `invalid_api_key`. The secret itself is never logged or stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from helexa.errors import invalid_api_key
from helexa.gateway.keys import KeyInfo, KeyStore, hash_secret
from helexa.protocol.wire import bearer_token

log = logging.getLogger(__name__)

# A key's lookup (its models, its budget, whether it is revoked) is reused this long; the
# poller's DatabaseSync also drops every one each poll interval, so a change made through
# another gateway or `helexa keys` is seen within the shorter of the two.
CACHE_TTL_S = 2.0
CACHE_MAX = 10_000
# a lookup this close to its expiry is read again in the background while it is still
# served: a busy key's requests never wait for the database, and never all at once
REFRESH_AHEAD_S = 0.5


@dataclass(frozen=True, slots=True)
class Principal:
    key: KeyInfo | None = None

    @property
    def account_id(self) -> str | None:
        return self.key.account_id if self.key else None

    @property
    def key_id(self) -> str | None:
        return self.key.id if self.key else None


ANONYMOUS = Principal()


def bearer_secret(headers: Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer <key>`, else from `x-api-key: <key>`."""
    secret = bearer_token(headers.get("authorization"))
    return secret or (headers.get("x-api-key") or "").strip() or None


class Authenticator:
    def __init__(self, store: KeyStore, *, require_auth: bool) -> None:
        self.store = store
        self.require_auth = require_auth
        self._cache: dict[str, tuple[float, KeyInfo | None]] = {}  # hash -> (expiry, key)
        self._forgotten = 0  # forget() calls: a lookup that spans one is not cached
        # hash -> the lookup on its way: every request for that key waits for this one
        self._reading: dict[str, asyncio.Task[KeyInfo | None]] = {}

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        secret = bearer_secret(headers)
        if secret is None:
            if self.require_auth:
                raise invalid_api_key(
                    "an API key is required: send Authorization: Bearer <key> or x-api-key"
                )
            return ANONYMOUS
        key = await self._lookup(secret)
        if key is None:
            if self.require_auth:
                raise invalid_api_key("the API key is not valid (unknown or revoked)")
            return ANONYMOUS
        return Principal(key)

    def forget(self) -> None:
        """Drop every cached lookup: the next request with each key reads the database."""
        self._cache.clear()
        self._forgotten += 1

    async def _lookup(self, secret: str) -> KeyInfo | None:
        """The key a secret names: from the cache (read again in the background shortly
        before it expires), else from one database read shared by every request for it."""
        digest = hash_secret(secret)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            if hit[0] - now < REFRESH_AHEAD_S and digest not in self._reading:
                self._read(digest, secret).add_done_callback(_refresh_done)
            return hit[1]
        reading = self._reading.get(digest) or self._read(digest, secret)
        return await asyncio.shield(reading)  # a waiter leaving does not cancel the others'

    def _read(self, digest: str, secret: str) -> asyncio.Task[KeyInfo | None]:
        task = asyncio.get_running_loop().create_task(self._fetch(digest, secret))
        self._reading[digest] = task
        return task

    async def _fetch(self, digest: str, secret: str) -> KeyInfo | None:
        started, forgotten = time.monotonic(), self._forgotten
        try:
            key = await asyncio.to_thread(self.store.lookup, secret)
        finally:
            self._reading.pop(digest, None)
        if forgotten == self._forgotten:  # else it may predate the change forget() is for
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[digest] = (started + CACHE_TTL_S, key)
        return key


def _refresh_done(task: asyncio.Task[KeyInfo | None]) -> None:
    """A background read that failed leaves the cached lookup to expire as it would."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("reading an API key again failed: %s", task.exception())
