"""The gateway's key for each node (SPEC "Node", Access), through real gateway and node
processes: every call carries it, from `[[nodes]] api_key_env` or `api_key`; a node that
refuses it leaves routing and clients get a clean 503, never the node's 401."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import start_node

KEY_A, KEY_B = "node-a-key-0123456789", "node-b-key-9876543210"
ADMIN_PASSWORD = "correct horse battery"


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **kw}


def _message(model: str, **kw) -> dict:
    return {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], **kw}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _wait_for(check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("keyed-nodes")
    tiny = model_dirs["tiny"]
    a = start_node(tmp / "a", [tiny], node={"api_key": KEY_A})
    b = start_node(tmp / "b", [tiny], node={"api_key": KEY_B})
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def gw(tmp_path_factory, nodes, model_dirs):
    from helexa.passwords import hash_password

    a, b = nodes
    gw = start_gateway(
        tmp_path_factory.mktemp("keyed-gw"),
        {"a": a, "b": b},
        models=[
            {"id": str(model_dirs["tiny"])},
            {"id": str(model_dirs["scripted"]), "pinned_on": ["b"]},
        ],
        node_entries={"a": {"api_key_env": "TEST_NODE_A_KEY"}, "b": {"api_key": KEY_B}},
        env={"TEST_NODE_A_KEY": KEY_A},
        gateway={"require_auth": False},
        admin={"password_hash": hash_password(ADMIN_PASSWORD)},
    )
    yield gw
    gw.stop()


def test_a_keyed_node_refuses_callers_without_its_key(nodes):
    a, _ = nodes
    for path in ("/models", "/discovery"):
        r = httpx.get(a.base_url + path, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert a.get("/models").status_code == 200  # the test's client sends the key


def test_the_gateway_polls_each_node_with_its_key_from_the_env_or_the_entry(gw, tiny_id):
    health = gw.get("/health").json()
    assert health["nodes_up"] == 2
    assert [loc["node"] for loc in gw.models()[tiny_id]["locations"]] == ["a", "b"]


def test_chat_and_messages_reach_keyed_nodes_streamed_or_not(gw, tiny_id):
    r = gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=3))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    body = _chat(tiny_id, max_tokens=3, stream=True)
    with httpx.stream("POST", gw.v1 + "/chat/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 2
    r = gw.post("/v1/messages", _message(tiny_id))
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    with httpx.stream(
        "POST", gw.v1 + "/messages", json=_message(tiny_id, stream=True), timeout=60
    ) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("event: ")]
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
    r = gw.post("/v1/messages/count_tokens", _message(tiny_id))
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_the_clients_own_key_never_reaches_the_node(gw, nodes, tiny_id):
    # were the client's Bearer passed on, the node would refuse it (it is not the node's key)
    r = gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=2), headers=_bearer("sk-mine"))
    assert r.status_code == 200, r.text
    r = gw.post("/v1/messages", _message(tiny_id), headers={"x-api-key": "sk-mine"})
    assert r.status_code == 200, r.text
    assert all("sk-mine" not in node.log() for node in nodes)


def test_a_cold_load_reaches_the_keyed_node_it_is_pinned_on(gw, nodes, scripted_id):
    _, b = nodes
    r = gw.post("/v1/chat/completions", _chat(scripted_id, max_tokens=4))
    assert r.status_code == 200, r.text
    assert r.headers["x-helexa-node"] == "b"
    models = b.get("/models").json()
    assert scripted_id in {m["id"] for m in models}


def test_the_admin_console_loads_and_unloads_on_a_keyed_node(gw, nodes, model_dirs):
    a, _ = nodes
    tiny2 = str(model_dirs["tiny2"])

    def on_a() -> set[str]:
        models = a.get("/models").json()
        return {m["id"] for m in models if m["status"] == "loaded"}

    with httpx.Client(base_url=gw.base_url, timeout=30) as admin:
        token = _csrf(admin.get("/admin/login").text)
        login = admin.post("/admin/login", data={"csrf": token, "password": ADMIN_PASSWORD})
        assert login.status_code in (200, 303), login.text
        token = _csrf(admin.get("/admin/models").text)
        r = admin.post("/admin/models/load", data={"csrf": token, "node": "a", "model": tiny2})
        assert r.status_code == 200, r.text
        _wait_for(lambda: tiny2 in on_a())
        r = admin.post("/admin/models/unload", data={"csrf": token, "node": "a", "model_id": tiny2})
        assert r.status_code == 200, r.text
        _wait_for(lambda: tiny2 not in on_a())


def _csrf(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page)[1]


def test_a_gateway_with_a_wrong_key_sees_the_node_down_and_answers_a_clean_503(
    tmp_path, nodes, tiny_id
):
    a, _ = nodes
    gw = start_gateway(
        tmp_path, {"a": a}, node_entries={"a": {"api_key": "not-the-key"}}, wait_up=False
    )
    try:
        health = _wait_for(lambda: (h := gw.get("/health").json())["nodes"][0]["last_error"] and h)
        assert health["nodes_up"] == 0
        assert "api_key" in health["nodes"][0]["last_error"]
        r = gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=2))
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "service_unavailable" and r.headers["Retry-After"]
        assert "Invalid API key" not in r.text and "not-the-key" not in r.text
        r = gw.post("/v1/messages", _message(tiny_id))
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert "Invalid API key" not in r.text
        log = gw.log()
        assert "refused the gateway's api_key" in log and "not-the-key" not in log
    finally:
        gw.stop()
