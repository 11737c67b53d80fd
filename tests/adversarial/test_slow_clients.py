"""Clients that hold a node's resources by being slow: headers that never finish, idle
keep-alive connections, streams nobody reads, a flood of slow readers. Real node
processes; raw sockets play the clients."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import time

import httpx
import pytest

from tests.web.node_proc import scripted_model, start_node

LONG_SCRIPT = "word " * 6000  # ~6000 tokens of SSE: far more than socket buffers hold


@pytest.fixture(scope="module")
def long_script(tmp_path_factory):
    return scripted_model(tmp_path_factory.mktemp("long"), LONG_SCRIPT, "long-script")


def _port(node) -> int:
    return int(node.base_url.rsplit(":", 1)[1])


def _connect(node, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.connect(("127.0.0.1", _port(node)))
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes `s` within `seconds` (reading and dropping what it sent)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([s], [], [], 0.2)
        if ready:
            try:
                if not s.recv(65536):
                    return True
            except ConnectionResetError:
                return True
    return False


def _stream_request(model: str, max_tokens: int = 7000) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "max_tokens": max_tokens,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@pytest.fixture(scope="module")
def strict(tmp_path_factory, scripted_id, long_script):
    node = start_node(
        tmp_path_factory.mktemp("strict"),
        [scripted_id, long_script],
        node={"stream_write_timeout_s": 1.0},
        engine={"kv_cache_memory_mb": 64},
        env={"HELEXA_HTTP_HEADER_TIMEOUT_S": "1", "HELEXA_HTTP_KEEP_ALIVE_TIMEOUT_S": "1"},
    )
    yield node
    node.stop()


def test_headers_that_never_finish_are_dropped_and_others_are_served(strict, scripted_id):
    slow = _connect(strict)
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: node\r\n")  # ...and never the blank line
    idle = _connect(strict)  # connects and sends nothing at all
    ok = strict.post(
        "/v1/chat/completions",
        {"model": scripted_id, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert ok.status_code == 200
    assert _closed_within(slow, 5)
    assert _closed_within(idle, 5)


def test_an_idle_keep_alive_connection_is_closed(strict):
    s = _connect(strict)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: node\r\n\r\n")
    assert b"200 OK" in s.recv(65536)
    assert _closed_within(s, 5)


def _kv_usage(node, model: str) -> float:
    for line in node.get("/metrics").text.splitlines():
        if line.startswith("helexa_kv_cache_usage{") and f'"{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kv usage metric")


def test_a_stream_nobody_reads_is_cut_and_frees_its_slot_and_kv(strict, long_script):
    model = str(long_script)
    s = _connect(strict, rcvbuf=4096)
    s.sendall(_stream_request(model))
    assert s.recv(200).startswith(b"HTTP/1.1 200")  # then nothing more is read
    held = next(m for m in strict.get("/health").json()["models"] if m["id"] == model)
    assert held["in_flight"] == 1
    assert _kv_usage(strict, model) > 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held = next(m for m in strict.get("/health").json()["models"] if m["id"] == model)
        if held["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert held["in_flight"] == 0
    assert _kv_usage(strict, model) == 0.0
    log = strict.log()
    assert "read nothing for 1s" in log
    line = next(x for x in log.splitlines() if "helexa.node.requests" in x and model in x)
    assert "finish_reason='abort'" in line  # cut short: the answer was ~6000 tokens long
    tokens = int(line.split("completion_tokens=")[1].split()[0])
    assert 0 < tokens < 6000
    s.close()


def test_past_the_connection_limit_new_requests_get_a_503_envelope(tmp_path_factory, scripted_id):
    node = start_node(
        tmp_path_factory.mktemp("limited"),
        [scripted_id],
        env={"HELEXA_HTTP_LIMIT_CONCURRENCY": "4", "HELEXA_HTTP_HEADER_TIMEOUT_S": "30"},
    )
    try:
        idle = [_connect(node) for _ in range(4)]
        time.sleep(0.3)
        r = httpx.get(node.base_url + "/models", timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        assert int(r.headers["retry-after"]) >= 1
        for s in idle:
            s.close()
        time.sleep(0.3)
        assert httpx.get(node.base_url + "/models", timeout=10).status_code == 200
    finally:
        node.stop()


def test_a_hundred_slow_readers_do_not_keep_a_normal_request_waiting(
    tmp_path_factory, scripted_id, long_script
):
    """The attacker's streams come from 127.0.0.2: its address's cap turns most away at
    once, and the few admitted are cut when they stop reading; a caller from another
    address is answered as fast as when alone."""
    node = start_node(
        tmp_path_factory.mktemp("flood"),
        [scripted_id, long_script],
        node={"per_principal_max": 2, "stream_write_timeout_s": 2.0},
        engine={"kv_cache_memory_mb": 64},
    )
    body = {"model": scripted_id, "messages": [{"role": "user", "content": "Hi"}]}
    try:
        t0 = time.monotonic()
        assert node.post("/v1/chat/completions", body).status_code == 200
        solo = time.monotonic() - t0
        readers = []
        for _ in range(100):
            s = _connect(node, source="127.0.0.2", rcvbuf=4096)
            s.sendall(_stream_request(str(long_script)))
            readers.append(s)
        statuses = []
        for s in readers:  # each reads its status line, then a trickle
            head = s.recv(64)
            statuses.append(head.split(b" ")[1] if head else b"closed")
        assert statuses.count(b"429") >= 98, statuses
        t0 = time.monotonic()
        r = node.post("/v1/chat/completions", body)
        beside = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert beside < max(2.0, 10 * solo), (solo, beside)
        print(f"normal request: {solo * 1000:.0f} ms alone, {beside * 1000:.0f} ms beside")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the admitted ones read a byte a second
            for s in readers:
                with contextlib.suppress(BlockingIOError, ConnectionResetError):
                    s.recv(1, socket.MSG_DONTWAIT)
            health = node.get("/health").json()["models"]
            if all(m["in_flight"] == 0 for m in health):
                break
            time.sleep(1)
        assert all(m["in_flight"] == 0 for m in health), health
        assert node.log().count("read nothing for 2s") == 2
    finally:
        for s in readers:
            s.close()
        node.stop()
