"""Who may call, through a real gateway and a real node (SPEC "Gateway", Identity)."""

from __future__ import annotations

import time

import httpx
import pytest

from helexa.db.session import make_engine, session_factory
from helexa.gateway.keys import KeyStore
from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import start_node
from tests.web.test_node_lifecycle import HeldStream

NODE_KEY = "node-s3cret"


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **kw}


def _bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dirs):
    node = start_node(
        tmp_path_factory.mktemp("auth-node"),
        [model_dirs["tiny"], model_dirs["long"]],
        node={"api_key": NODE_KEY, "per_principal_max": 2},
    )
    yield node
    node.stop()


def _gateway(tmp, node, **gateway):
    return start_gateway(tmp, {"n": node}, gateway=gateway, node={"api_key": NODE_KEY})


def _store(gw) -> KeyStore:
    return KeyStore(session_factory(make_engine(gw.database_url)))


@pytest.fixture(scope="module")
def open_gw(tmp_path_factory, node):
    gw = _gateway(tmp_path_factory.mktemp("open-gw"), node)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def closed_gw(tmp_path_factory, node):
    gw = _gateway(tmp_path_factory.mktemp("closed-gw"), node, require_auth=True)
    yield gw
    gw.stop()


def test_open_gateway_serves_no_key_and_unknown_keys_anonymously(open_gw, tiny_id):
    assert open_gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=2)).status_code == 200
    r = open_gw.post(
        "/v1/chat/completions", _chat(tiny_id, max_tokens=2), headers=_bearer("sk-placeholder")
    )
    assert r.status_code == 200


def test_a_known_key_reaches_the_node_as_its_principal(open_gw, node, long_id):
    _, secret = _store(open_gw).create("acme", name="ci")
    held = [
        HeldStream(open_gw, _chat(long_id, max_tokens=8000, ignore_eos=True), _bearer(secret))
        for _ in range(2)
    ]
    try:
        # the node caps one principal at 2: the stamped key counts (it came with the node's key)
        r = open_gw.post("/v1/chat/completions", _chat(long_id), headers=_bearer(secret))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        anon = open_gw.post("/v1/chat/completions", _chat(long_id, max_tokens=2))
        assert anon.status_code == 200  # others are still served
    finally:
        for h in held:
            h.close()
    assert secret not in open_gw.log() and secret not in node.log()


def test_client_sent_principal_headers_are_stripped(open_gw, long_id):
    forged = {"x-helexa-account-id": "victim", "x-helexa-key-id": "key_victim"}
    forged["x-helexa-gateway-secret"] = "guess"
    held = [
        HeldStream(open_gw, _chat(long_id, max_tokens=8000, ignore_eos=True), forged)
        for _ in range(2)
    ]
    try:
        r = open_gw.post("/v1/chat/completions", _chat(long_id, max_tokens=2), headers=forged)
        assert r.status_code == 200  # anonymous, so not capped as "victim"
    finally:
        for h in held:
            h.close()


def test_a_closed_gateway_refuses_missing_unknown_and_revoked_keys_with_401(closed_gw, tiny_id):
    for headers in ({}, _bearer("sk-nope"), {"Authorization": "Basic abc"}):
        r = closed_gw.post("/v1/chat/completions", _chat(tiny_id), headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert closed_gw.get("/v1/models").status_code == 401
    store = _store(closed_gw)
    info, secret = store.create("acme")
    ok = closed_gw.post(
        "/v1/chat/completions", _chat(tiny_id, max_tokens=2), headers=_bearer(secret)
    )
    assert ok.status_code == 200
    store.revoke(info.id)
    time.sleep(2.2)  # the gateway caches lookups for 2 s
    r = closed_gw.post("/v1/chat/completions", _chat(tiny_id), headers=_bearer(secret))
    assert r.status_code == 401


def test_a_key_scoped_to_models_sees_only_those(closed_gw, tiny_id, long_id):
    _, secret = _store(closed_gw).create("acme", models=[tiny_id])
    r = closed_gw.post("/v1/chat/completions", _chat(long_id), headers=_bearer(secret))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    ok = closed_gw.post(
        "/v1/chat/completions", _chat(tiny_id, max_tokens=2), headers=_bearer(secret)
    )
    assert ok.status_code == 200
    listed = httpx.get(closed_gw.v1 + "/models", headers=_bearer(secret), timeout=10).json()
    assert [m["id"] for m in listed["data"]] == [tiny_id]


def test_the_deprecated_gateway_secret_still_keys_the_nodes_and_warns(tmp_path, node, tiny_id):
    gw = start_gateway(tmp_path, {"n": node}, node={"gateway_secret": NODE_KEY})
    try:
        r = gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=2))
        assert r.status_code == 200, r.text
        assert "[node] gateway_secret is deprecated" in gw.log()
    finally:
        gw.stop()
