"""What an operator reads: one line per request when it ends, under the request id the
client sent (or one the node made), which every response carries back."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.web.node_proc import start_node


@pytest.fixture(scope="module")
def logged(tmp_path_factory, scripted_id):
    node = start_node(tmp_path_factory.mktemp("logged"), [scripted_id])
    yield node
    node.stop()


def _line(node, request_id: str) -> str:
    # The node writes the line just after the answer's last byte leaves, so a client that
    # has read the whole answer can look before it is there: allow it a moment.
    deadline = time.monotonic() + 5
    while True:
        lines = [x for x in node.log().splitlines() if f"request_id='{request_id}'" in x]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(lines) == 1, lines
    return lines[0]


def _fields(line: str) -> dict[str, str]:
    return {k: v.strip("'") for k, v in re.findall(r"(\w+)=('[^']*'|\S+)", line)}


def test_a_request_ends_in_one_line_with_its_id_tokens_and_timings(logged, scripted_id):
    body = {"model": scripted_id, "messages": [{"role": "user", "content": "Hi"}]}
    r = logged.post("/v1/chat/completions", body, headers={"x-request-id": "trace-42.a:b"})
    assert r.headers["x-request-id"] == "trace-42.a:b"
    usage = r.json()["usage"]
    f = _fields(_line(logged, "trace-42.a:b"))
    assert f["model"] == scripted_id and f["status"] == "200"
    assert int(f["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(f["completion_tokens"]) == usage["completion_tokens"]
    assert f["finish_reason"] == "stop"
    assert 0 < float(f["ttft_ms"]) <= float(f["total_ms"])


def test_a_stream_is_logged_when_it_ends(logged, scripted_id):
    body = {"model": scripted_id, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with httpx.stream(
        "POST", logged.v1 + "/chat/completions", json=body, headers={"x-request-id": "s-1"}
    ) as r:
        assert r.headers["x-request-id"] == "s-1"
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    f = _fields(_line(logged, "s-1"))
    assert f["status"] == "200" and f["finish_reason"] == "stop"
    assert int(f["completion_tokens"]) > 0


def test_errors_carry_and_log_their_request_id_too(logged):
    r = logged.post(
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]},
        headers={"x-request-id": "e-1"},
    )
    assert r.status_code == 404 and r.headers["x-request-id"] == "e-1"
    f = _fields(_line(logged, "e-1"))
    assert f["status"] == "404" and f["model"] == "nope"


def test_an_unusable_request_id_is_replaced_by_a_fresh_one(logged, scripted_id):
    for bad in ("has spaces", "x" * 200, "new\u00e9line"):
        r = httpx.get(logged.base_url + "/models/nope", headers={"x-request-id": bad.encode()})
        made = r.headers["x-request-id"]
        assert made != bad and re.fullmatch(r"[0-9a-f]{32}", made)
    r = logged.get("/health")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
