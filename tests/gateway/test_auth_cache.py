"""The key lookups' cache (helexa/gateway/auth.py) over a real key store: every request
for a key whose lookup is not cached waits for one database read, a busy key is read again
in the background before its lookup expires, and a revoked key stops being served once
its lookup expires."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from helexa.db.session import make_engine, session_factory, upgrade
from helexa.gateway import auth
from helexa.gateway.auth import ANONYMOUS, Authenticator
from helexa.gateway.keys import KeyInfo, KeyStore


class CountingStore(KeyStore):
    """The real store, its lookups counted and each one made to take `delay_s`."""

    def __init__(self, sessions, delay_s: float = 0.0) -> None:
        super().__init__(sessions)
        self.delay_s = delay_s
        self.lookups = 0
        self._lock = threading.Lock()

    def lookup(self, secret: str) -> KeyInfo | None:
        with self._lock:
            self.lookups += 1
        time.sleep(self.delay_s)
        return super().lookup(secret)


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'helexa.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield CountingStore(session_factory(engine), delay_s=0.1)
    engine.dispose()


def _headers(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def test_requests_for_one_uncached_key_share_one_database_read(store):
    key, secret = store.create("acme")
    authenticator = Authenticator(store, require_auth=True)

    async def main():
        return await asyncio.gather(
            *(authenticator.authenticate(_headers(secret)) for _ in range(50))
        )

    principals = asyncio.run(main())
    assert {p.key_id for p in principals} == {key.id}
    assert store.lookups == 1


def test_a_busy_keys_lookup_is_read_again_before_it_expires_without_a_wait(store, monkeypatch):
    monkeypatch.setattr(auth, "CACHE_TTL_S", 0.6)
    monkeypatch.setattr(auth, "REFRESH_AHEAD_S", 0.2)  # > a read's 0.1 s
    key, secret = store.create("acme")
    authenticator = Authenticator(store, require_auth=True)

    async def main() -> list[float]:
        await authenticator.authenticate(_headers(secret))  # read: cached for 0.6 s
        waits = []
        for _ in range(12):  # 1.2 s of requests: past two expiries
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            principal = await authenticator.authenticate(_headers(secret))
            waits.append(time.monotonic() - t0)
            assert principal.key_id == key.id
        return waits

    waits = asyncio.run(main())
    assert max(waits) < 0.05  # each read (0.1 s) happened behind a served lookup
    assert 2 <= store.lookups <= 5  # one read about every 0.4-0.5 s, never one each


def test_a_revoked_key_is_refused_once_its_lookup_expires(store, monkeypatch):
    monkeypatch.setattr(auth, "CACHE_TTL_S", 0.3)
    monkeypatch.setattr(auth, "REFRESH_AHEAD_S", 0.1)
    key, secret = store.create("acme")
    store.delay_s = 0.0
    open_gateway = Authenticator(store, require_auth=False)

    async def main():
        first = await open_gateway.authenticate(_headers(secret))
        store.revoke(key.id)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2:
            principal = await open_gateway.authenticate(_headers(secret))
            if principal is ANONYMOUS:
                return first, time.monotonic() - t0
            await asyncio.sleep(0.02)
        return first, None

    first, after = asyncio.run(main())
    assert first.key_id == key.id
    assert after is not None and after <= 0.3 + 0.2  # within its lookup's life (+ a read)
