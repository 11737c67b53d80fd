"""Browsers and big bodies at a real gateway: `[gateway] cors_allow_origins` (preflights
answered before auth, allow headers only for listed origins) and `[http] max_body_mb`."""

from __future__ import annotations

import httpx
import pytest

from helexa.db.session import make_engine, session_factory
from helexa.gateway.keys import KeyStore
from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import start_node

APP = "https://app.example"
REQUIRED_ALLOW = {
    "authorization",
    "content-type",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "x-request-id",
}


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **kw}


def _preflight(gw, path: str, origin: str, headers: str = "authorization, content-type"):
    return httpx.options(
        gw.v1 + path,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": headers,
        },
        timeout=10,
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("cors")
    node = start_node(tmp / "n", [model_dirs["tiny"]], node={"api_key": "k"})
    gw = start_gateway(
        tmp,
        {"n": node},
        node={"api_key": "k"},
        gateway={"require_auth": True, "cors_allow_origins": [APP, "http://localhost:5173"]},
        http={"max_body_mb": 1},
    )
    _, secret = KeyStore(session_factory(make_engine(gw.database_url))).create("web")
    yield gw, {"Authorization": f"Bearer {secret}"}
    gw.stop()
    node.stop()


@pytest.mark.parametrize("path", ["/chat/completions", "/messages", "/models"])
def test_a_preflight_from_a_listed_origin_is_answered_before_auth(fleet, path):
    gw, _ = fleet
    r = _preflight(gw, path, APP, "authorization, content-type, x-stainless-os, anthropic-version")
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == APP
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert REQUIRED_ALLOW | {"x-stainless-os"} <= allowed
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "Origin" in r.headers["vary"] and r.headers["x-request-id"]


def test_answers_to_a_listed_origin_carry_the_allow_headers_errors_included(fleet, tiny_id):
    gw, auth = fleet
    origin = {"Origin": "http://localhost:5173"}
    refused = httpx.post(gw.v1 + "/chat/completions", json=_chat(tiny_id), headers=origin)
    served = httpx.post(
        gw.v1 + "/chat/completions",
        json=_chat(tiny_id, max_tokens=2),
        headers={**origin, **auth},
        timeout=60,
    )
    assert (refused.status_code, served.status_code) == (401, 200)
    for r in (refused, served):
        assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "Origin" in r.headers["vary"]
        assert "x-request-id" in r.headers["access-control-expose-headers"]


def test_other_origins_get_no_allow_headers(fleet, tiny_id):
    gw, auth = fleet
    r = _preflight(gw, "/chat/completions", "https://evil.example")
    assert r.status_code == 403
    assert not any(h.startswith("access-control-allow") for h in r.headers)
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json=_chat(tiny_id, max_tokens=2),
        headers={"Origin": "https://evil.example", **auth},
        timeout=60,
    )
    assert r.status_code == 200  # not a browser: served, but a browser may not read it
    assert not any(h.startswith("access-control-") for h in r.headers)
    assert "Origin" in r.headers["vary"]


def test_without_origins_configured_there_are_no_cors_headers_at_all(tmp_path):
    gw = start_gateway(tmp_path, {}, gateway={"require_auth": True})
    try:
        r = _preflight(gw, "/chat/completions", APP)  # Litestar's own OPTIONS answer
        answer = httpx.get(gw.v1 + "/models", headers={"Origin": APP}, timeout=10)
        assert answer.status_code == 401
        for each in (r, answer):
            assert not any(h.startswith("access-control-") for h in each.headers)
    finally:
        gw.stop()


def test_a_body_over_max_body_mb_is_refused_with_413_in_each_apis_shape(fleet, tiny_id):
    gw, auth = fleet
    big = "x" * (1 << 20)
    r = httpx.post(gw.v1 + "/chat/completions", json=_chat(tiny_id, stop=big), headers=auth)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "1 MiB" in error["message"]
    assert r.headers["x-request-id"]
    r = httpx.post(gw.v1 + "/messages", json={"model": tiny_id, "system": big}, headers=auth)
    assert r.status_code == 413, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "request_too_large"
    small = httpx.post(
        gw.v1 + "/chat/completions", json=_chat(tiny_id, max_tokens=2), headers=auth, timeout=60
    )
    assert small.status_code == 200
