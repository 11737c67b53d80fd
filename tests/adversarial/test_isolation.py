"""A request whose sampling fails, beside seven others on a real node: it alone gets an
error (a 500, or an error event on its stream) that names its request id but not the
cause, the cause is in the node's log, and the others stream their solo tokens."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from tests.web.node_proc import start_node

NUM_OTHERS = 7
MAX_TOKENS = 96  # the others are still generating when the failing request arrives


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_id):
    proc = start_node(
        tmp_path_factory.mktemp("isolation"),
        [tiny_id],
        node={"per_principal_max": 0, "max_running_requests": 16},
        env={"HELEXA_DEBUG_FAULT": "sampler"},
    )
    yield proc
    proc.stop()


def _body(model: str, i: int, **extra) -> dict:
    return {
        "model": model,
        "prompt": f"Request number {i} asks for a story about",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


@pytest.fixture(scope="module")
def solo(node, tiny_id) -> list[str]:
    """Each of the others' texts, run alone."""
    texts = []
    for i in range(NUM_OTHERS):
        r = node.post("/v1/completions", _body(tiny_id, i))
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


class _Streams:
    """The others, streamed on threads; `started` once each has its first token."""

    def __init__(self, node, model: str) -> None:
        self.texts: list[str | None] = [None] * NUM_OTHERS
        self.first = [threading.Event() for _ in range(NUM_OTHERS)]
        self.threads = [
            threading.Thread(target=self._run, args=(node, model, i)) for i in range(NUM_OTHERS)
        ]
        for t in self.threads:
            t.start()

    def _run(self, node, model: str, i: int) -> None:
        text = ""
        body = _body(model, i, stream=True)
        try:
            with httpx.stream("POST", node.v1 + "/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        text += chunk["choices"][0]["text"]
                        self.first[i].set()
            self.texts[i] = text
        finally:
            self.first[i].set()

    def wait_started(self) -> None:
        for e in self.first:
            assert e.wait(60)

    def join(self) -> list[str | None]:
        for t in self.threads:
            t.join(120)
        return self.texts


def _assert_generic_and_logged(node, message: str) -> None:
    """The client sees the request id, not the cause; the log has both."""
    assert "HELEXA_DEBUG_FAULT" not in message and "RuntimeError" not in message, message
    found = re.search(r"request id (\S+)\)", message)
    assert found, message
    request_id = found.group(1)
    log = node.log()
    assert f"request {request_id} on" in log
    assert "fault injected by HELEXA_DEBUG_FAULT=sampler" in log


def test_a_failing_request_gets_a_500_while_seven_beside_it_get_their_solo_tokens(
    node, tiny_id, solo
):
    others = _Streams(node, tiny_id)
    others.wait_started()
    r = node.post("/v1/completions", _body(tiny_id, 99, user="helexa-debug-fault"))
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error"
    _assert_generic_and_logged(node, error["message"])
    assert others.join() == solo


def test_a_failing_stream_gets_an_error_event_while_seven_beside_it_get_their_solo_tokens(
    node, tiny_id, solo
):
    others = _Streams(node, tiny_id)
    others.wait_started()
    body = _body(tiny_id, 99, user="helexa-debug-fault", stream=True)
    with httpx.stream("POST", node.v1 + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error"
    _assert_generic_and_logged(node, error["message"])
    assert others.join() == solo


def test_the_model_is_not_poisoned_by_one_request_failing(node, tiny_id, solo):
    models = node.get("/models").json()
    assert [m["status"] for m in models if m["id"] == tiny_id] == ["loaded"]
    r = node.post("/v1/completions", _body(tiny_id, 0))
    assert r.json()["choices"][0]["text"] == solo[0]
