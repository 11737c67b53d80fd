"""Clients that hold a node's resources by being slow: headers that never finish, idle
keep-alive connections, streams nobody reads, a flood of slow readers. Real node
processes; raw sockets play the clients."""

from __future__ import annotations

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


def _status(s: socket.socket, wait_s: float) -> bytes | None:
    """The status code `s` was answered with, if an answer comes within `wait_s`."""
    ready, _, _ = select.select([s], [], [], wait_s)
    if not ready:
        return None
    try:
        head = s.recv(64)
    except ConnectionResetError:
        return b"reset"
    return head.split(b" ")[1] if head else b"closed"


def _load(node, model: str) -> tuple[int, int]:
    m = next(m for m in node.get("/health").json()["models"] if m["id"] == model)
    return m["in_flight"], m["queue_depth"]


def test_a_hundred_slow_readers_do_not_shut_a_normal_request_out(tmp_path_factory, long_script):
    """The attacker's streams come from 127.0.0.2 and never read: the running set and the
    queue take what they hold, the rest are turned away at once, and each admitted one is
    cut when it stops reading. A caller from another address is still served, by the same
    model, ahead of every stream the attacker has queued: no lane can take the whole queue."""
    model = str(long_script)
    node = start_node(
        tmp_path_factory.mktemp("flood"),
        [long_script],
        node={
            "max_running_requests": 4,
            "max_waiting_requests": 8,
            "stream_write_timeout_s": 2.0,
            # a running stream holds its slot until ~half a MiB of SSE is buffered for it
            # and then 2 s more: thousands of tokens, which a loaded CI box takes well over
            # the default 30 s to make. The waits below are about order, not speed.
            "max_queue_wait_s": 180.0,
        },
        engine={"kv_cache_memory_mb": 64},
    )
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    readers: list[socket.socket] = []
    try:
        for _ in range(100):
            s = _connect(node, source="127.0.0.2", rcvbuf=4096)
            s.sendall(_stream_request(model))
            readers.append(s)
        statuses: dict[int, bytes] = {}
        deadline = time.monotonic() + 60  # a hang guard: the answers below come at once
        while len(statuses) < 100 - 8 and time.monotonic() < deadline:
            for i, s in enumerate(readers):
                if i not in statuses and (status := _status(s, 0)) is not None:
                    statuses[i] = status
            time.sleep(0.05)
        refused = [i for i, st in statuses.items() if st == b"503"]
        assert len(refused) == 100 - 4 - 8, statuses  # what neither runs nor queues
        assert _load(node, model)[1] > 0, "no attacker stream is queued: nothing was tested"

        r = node.post("/v1/chat/completions", body)  # 127.0.0.1, while the queue is full
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        # served ahead of the attacker's queue: some of its streams are still waiting
        assert _load(node, model)[1] > 0

        deadline = time.monotonic() + 300  # the rest run in turn, each cut when it stalls
        while _load(node, model) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _load(node, model) == (0, 0)
        for i, s in enumerate(readers):
            if i not in statuses:
                statuses[i] = _status(s, 5) or b"none"
        # every stream was answered: run (and cut, or finished into its socket buffers),
        # or turned away with a 503 (at once, after its wait, or to make room)
        assert set(statuses.values()) <= {b"200", b"503"}, statuses
        assert list(statuses.values()).count(b"200") > 4, statuses  # the queue was served
        assert "read nothing for 2s" in node.log()
    finally:
        for s in readers:
            s.close()
        node.stop()
