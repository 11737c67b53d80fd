"""Hostile headers and bodies at a real gateway: request ids at and past their bounds, a
doubled id, CORS kept off the admin console, and an oversized body sent without a length."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.gateway.gateway_proc import start_gateway

HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    gw = start_gateway(
        tmp_path_factory.mktemp("hostile"),
        {},
        gateway={"cors_allow_origins": ["*"]},
        http={"max_body_mb": 1},
        admin={"password_hash": _hash()},
    )
    yield gw
    gw.stop()


def _hash() -> str:
    from helexa.passwords import hash_password

    return hash_password("pw")


def test_a_request_id_of_128_sane_characters_is_kept_and_129_is_not(gw):
    edge = "a.b:c_d-" * 16
    assert len(edge) == 128
    kept = httpx.get(gw.v1 + "/models", headers={"x-request-id": edge})
    assert kept.headers["x-request-id"] == edge
    replaced = httpx.get(gw.v1 + "/models", headers={"x-request-id": edge + "e"})
    assert HEX32.fullmatch(replaced.headers["x-request-id"])


@pytest.mark.parametrize("bad", ["\u00e9t\u00e9", "a\tb", "<script>", "id%0d%0aSet-Cookie"])
def test_request_ids_outside_the_safe_alphabet_are_replaced(gw, bad):
    r = httpx.get(gw.v1 + "/models", headers=[(b"x-request-id", bad.encode("latin-1", "replace"))])
    assert HEX32.fullmatch(r.headers["x-request-id"])


def test_a_doubled_request_id_comes_back_once(gw):
    r = httpx.get(gw.v1 + "/models", headers=[("x-request-id", "one"), ("x-request-id", "two")])
    assert r.headers.get_list("x-request-id") == ["one"]


def test_cors_never_opens_the_admin_console(gw):
    r = httpx.options(
        gw.base_url + "/admin/login",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in r.headers
    page = httpx.get(gw.base_url + "/admin/login", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in page.headers


def test_a_wildcard_origin_list_allows_any_origin_without_credentials(gw):
    r = httpx.options(
        gw.v1 + "/chat/completions",
        headers={"Origin": "https://anywhere.example", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in r.headers


def test_an_oversized_body_without_a_length_is_cut_off_with_413(gw):
    def chunks():
        for _ in range(40):
            yield b"x" * (64 << 10)  # 2.5 MiB in all, past the 1 MiB limit

    r = httpx.post(
        gw.v1 + "/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
