"""A node that vanishes between two polls, through a real gateway: the client is told which
node failed and to retry, never the wire detail (addresses, ports, exception text), which
goes to the gateway's log. Covers the proxy (OpenAI and Anthropic), token counting, and a
cold load."""

from __future__ import annotations

import signal

import pytest

from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import start_node

WIRE = ("127.0.0.1", "Connect", "connect", "Errno", "ClientConnector", "ssl:", "Cannot")


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **kw}


def _message(model: str) -> dict:
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


def assert_no_wire_detail(text: str, port: str) -> None:
    assert port not in text, text
    assert not any(w in text for w in WIRE), text


@pytest.fixture
def vanished(tmp_path, model_dirs):
    """A gateway that saw node `n` up, polling too seldom to notice it is gone."""
    node = start_node(tmp_path / "n", [model_dirs["tiny"]], node={"api_key": "k"})
    gw = start_gateway(
        tmp_path,
        {"n": node},
        node={"api_key": "k"},
        models=[{"id": str(model_dirs["tiny"])}, {"id": str(model_dirs["scripted"])}],
        poll_interval_s=600,
    )
    node.stop(signal.SIGKILL)
    yield gw, node.base_url.rsplit(":", 1)[1]
    gw.stop()


def test_a_chat_to_a_vanished_node_names_it_and_logs_the_detail(vanished, tiny_id):
    gw, port = vanished
    r = gw.post("/v1/chat/completions", _chat(tiny_id, max_tokens=2))
    assert r.status_code == 503 and r.headers["Retry-After"]
    error = r.json()["error"]
    assert error["message"] == "node n could not be reached; retry shortly"
    assert error["code"] == "service_unavailable"
    assert_no_wire_detail(r.text, port)
    assert port in gw.log()  # the operator still gets the detail
    [node] = gw.get("/health").json()["nodes"]
    assert (node["up"], node["last_error"]) == (False, "not answering")


def test_an_anthropic_message_to_a_vanished_node_names_it_only(vanished, tiny_id):
    gw, port = vanished
    r = gw.post("/v1/messages", _message(tiny_id))
    assert r.status_code == 503
    assert r.json()["type"] == "error"
    assert "node n could not be reached" in r.json()["error"]["message"]
    assert_no_wire_detail(r.text, port)


def test_counting_tokens_on_a_vanished_node_names_it_only(vanished, tiny_id):
    gw, port = vanished
    r = gw.post("/v1/messages/count_tokens", _message(tiny_id))
    assert r.status_code == 503
    assert "node n could not be reached" in r.json()["error"]["message"]
    assert_no_wire_detail(r.text, port)


def test_a_cold_load_on_a_vanished_node_names_it_only(vanished, scripted_id):
    gw, port = vanished
    r = gw.post("/v1/chat/completions", _chat(scripted_id, max_tokens=2))
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "could not load model" in message and "node n could not be reached" in message
    assert_no_wire_detail(r.text, port)
    assert port in gw.log()
