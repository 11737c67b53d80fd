"""Who is calling (docs/gateway.md § Keys and who is calling): a key looked up by its hash, sent as
`Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic clients),
on every route.

`require_auth = false`: no key or an unknown key is served anonymously (clients send
placeholder keys); a known key is metered. `require_auth = true`: missing or unknown →
401 `invalid_api_key`. The secret itself is never logged or stored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

from helexa.errors import invalid_api_key
from helexa.gateway.keys import KeyInfo, KeyStore, hash_secret
from helexa.protocol.wire import bearer_token

# A key's lookup (its models, its budget, whether it is revoked) is reused this long; the
# poller's DatabaseSync also drops every one each poll interval, so a change made through
# another gateway or `helexa keys` is seen within the shorter of the two.
CACHE_TTL_S = 2.0
CACHE_MAX = 10_000


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
        digest = hash_secret(secret)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        forgotten = self._forgotten
        key = await asyncio.to_thread(self.store.lookup, secret)
        if forgotten != self._forgotten:  # it may predate the change that forget() is for
            return key
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()
        self._cache[digest] = (now + CACHE_TTL_S, key)
        return key
