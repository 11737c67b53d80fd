"""Who counts against the per-principal cap on a node: anonymous direct callers by their
address, the gateway's keys by the headers it stamps, the gateway's anonymous traffic not
at all (the gateway caps it). Real node processes; the loopback range gives each simulated
client its own address."""

from __future__ import annotations

import httpx
import pytest

from tests.web.node_proc import start_node

LONG = {"max_tokens": 8000, "ignore_eos": True, "stream": True}
KEY = "node-key"


class Held:
    """A streaming chat from `address`, holding its admission slot until `close()`."""

    def __init__(self, node, model: str, address: str, headers: dict | None = None) -> None:
        self.client = httpx.Client(
            transport=httpx.HTTPTransport(local_address=address),
            headers={**node.auth, **(headers or {})},
            timeout=60,
        )
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], **LONG}
        self._cm = self.client.stream("POST", node.v1 + "/chat/completions", json=body)
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self.lines = self.response.iter_lines()  # kept: dropping it would close the stream
        next(self.lines)  # admitted and streaming

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
        self.client.close()


def _post(node, model: str, address: str, headers: dict | None = None) -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=address)
    with httpx.Client(transport=transport, headers={**node.auth, **(headers or {})}) as c:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        return c.post(node.v1 + "/chat/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def capped(tmp_path_factory, long_id):
    node = start_node(tmp_path_factory.mktemp("capped"), [long_id], node={"per_principal_max": 1})
    yield node
    node.stop()


def test_anonymous_direct_callers_are_capped_by_their_address(capped, long_id):
    held = Held(capped, long_id, "127.0.0.1")
    try:
        again = _post(capped, long_id, "127.0.0.1")
        assert again.status_code == 429, again.text
        assert again.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(again.headers["retry-after"]) >= 1
        other = _post(capped, long_id, "127.0.0.2")  # another address has its own share
        assert other.status_code == 200, other.text
        # the gateway's anonymous traffic is the gateway's to cap
        via = _post(capped, long_id, "127.0.0.1", {"x-helexa-via": "gateway"})
        assert via.status_code == 200, via.text
    finally:
        held.close()


def test_gateway_principals_count_by_key_not_by_address(capped, long_id):
    alice = {"x-helexa-account-id": "acct", "x-helexa-key-id": "alice"}
    held = Held(capped, long_id, "127.0.0.1", alice)
    try:
        assert _post(capped, long_id, "127.0.0.1", alice).status_code == 429
        bob = {"x-helexa-account-id": "acct", "x-helexa-key-id": "bob"}
        assert _post(capped, long_id, "127.0.0.1", bob).status_code == 200
    finally:
        held.close()


def test_on_a_keyed_node_gateway_headers_need_the_key(tmp_path_factory, long_id):
    node = start_node(
        tmp_path_factory.mktemp("keyed"),
        [long_id],
        node={"per_principal_max": 1, "api_key": KEY},
    )
    try:
        forged = {"x-helexa-account-id": "acct", "x-helexa-key-id": "k", "x-helexa-via": "gateway"}
        bare = httpx.post(
            node.v1 + "/chat/completions",
            json={"model": long_id, "messages": [{"role": "user", "content": "Hi"}]},
            headers=forged,
        )
        assert bare.status_code == 401  # nothing forged gets past the door
        # a budget header from the key holder binds: one output token fits, no more
        chat = {"model": long_id, "messages": [{"role": "user", "content": "Hi"}]}
        prompt = node.post("/tokenize", chat).json()["count"]
        tight = {**forged, "x-helexa-budget": f"tokens={prompt + 1}; cost=1.0; in=0; out=0"}
        r = _post(node, long_id, "127.0.0.1", tight)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
    finally:
        node.stop()
