"""`python bench/fake_node.py --port P`: a fake helexa node that answers at once.

It speaks just enough of a node's wire contract (docs/node.md) for the gateway's poller
and router and for OpenAI clients: `/discovery`, `/health`, `/models`,
`/models/fake-model[/endpoint]`, `/version`, `/metrics`, `/v1/models`, and
`/v1/chat/completions` and `/v1/completions`, streaming and not. Every answer is
rendered once and then written from a cache, over a hand-rolled HTTP/1.1 keep-alive
server on a bare asyncio Protocol (no framework), so that one core serves thousands of
requests a second and whatever sits in front of it is what gets measured.

A stream is a role chunk, one chunk per word, a finish chunk with `usage` (and a
`choices: []` usage chunk with `stream_options.include_usage`), then `data: [DONE]`,
all in one write: nothing sleeps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import time
from typing import Any

MODEL = "fake-model"
WORDS = ["Hello", " from", " the", " fake", " node."]
LIMIT = {"context": 8192, "input": 6144, "output": 2048}
USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": len(WORDS),
    "total_tokens": 12 + len(WORDS),
    "prompt_tokens_details": {"cached_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0},
}
MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_CACHED = 256  # rendered inference answers, keyed by (path, stream, usage chunk, model)
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _response(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _sse_response(events: list[Any]) -> bytes:
    """A chunked `text/event-stream` answer: one HTTP chunk per SSE event, then the end."""
    parts = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"cache-control: no-cache\r\nx-accel-buffering: no\r\ntransfer-encoding: chunked\r\n\r\n"
    ]
    for event in events:
        data = b"data: " + (event if isinstance(event, bytes) else _json(event)) + b"\n\n"
        parts.append(b"%x\r\n%s\r\n" % (len(data), data))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


def _error(status: int, kind: str, message: str) -> bytes:
    envelope = {"error": {"message": message, "type": kind, "param": None, "code": kind}}
    return _response(status, _json(envelope))


class FakeNode:
    """Every answer of the fake node, as ready-to-write HTTP/1.1 responses."""

    def __init__(self, endpoint: str) -> None:
        self.created = int(time.time())
        self.endpoint = endpoint
        entry = {
            "id": MODEL,
            "status": "loaded",
            "devices": [],
            "device": "cpu",
            "dtype": "float32",
            "quant": None,
            "format": "fake",
            "capabilities": ["text"],
            "tool_call": False,
            "reasoning": False,
            "limit": LIMIT,
            "memory_mb": 10,
            "in_flight": 0,
            "queue_depth": 0,
            "loaded_at": self.created,
            "load_seconds": 0.0,
        }
        cpu = {"kind": "cpu", "name": "fake", "memory_free_mb": 1024, "memory_total_mb": 2048}
        health = {
            "status": "ok",
            "uptime_s": 0.0,
            "devices": [{**cpu, "utilization_percent": 0.0}],
            "activation": {
                "state": "ready",
                "pending": [],
                "in_progress": None,
                "completed": [MODEL],
                "failed": [],
            },
            "models": [{"id": MODEL, "status": "loaded", "in_flight": 0, "queue_depth": 0}],
        }
        discovery = {
            "hostname": socket.gethostname(),
            "os": {"system": platform.system(), "release": platform.release(), "machine": "fake"},
            "cpu": {"model": "fake", "logical_cores": 1},
            "ram_mb": {"total": 2048, "available": 1024},
            "devices": [],
            "engines": {},
            "cuda_unavailable_reason": None,
            "max_prompt_tokens": LIMIT["input"],
        }
        card = {
            "id": MODEL,
            "object": "model",
            "created": self.created,
            "owned_by": "helexa",
            "root": MODEL,
            "max_model_len": LIMIT["context"],
            "limit": LIMIT,
            "capabilities": ["text"],
        }
        self.gets = {
            "/health": _response(200, _json(health)),
            "/discovery": _response(200, _json(discovery)),
            "/models": _response(200, _json([entry])),
            f"/models/{MODEL}": _response(200, _json(entry)),
            f"/models/{MODEL}/endpoint": _response(
                200, _json({"model_id": MODEL, "endpoint": self.endpoint})
            ),
            "/version": _response(200, _json({"version": "fake", "git_sha": None})),
            "/metrics": _response(200, b"", "text/plain; version=0.0.4; charset=utf-8"),
            "/v1/models": _response(200, _json({"object": "list", "data": [card]})),
        }
        self.cache: dict[tuple[str, bool, bool, str], bytes] = {}

    def answer(self, method: str, path: str, body: bytes) -> bytes:
        """The whole HTTP response to one request."""
        path = path.split("?", 1)[0]
        if method == "GET" and path in self.gets:
            return self.gets[path]
        if path not in ("/v1/chat/completions", "/v1/completions"):
            if path in self.gets:
                return _error(405, "invalid_request_error", f"{method} {path} is not allowed")
            return _error(404, "not_found", f"no route {method} {path}")
        if method != "POST":
            return _error(405, "invalid_request_error", f"{method} {path} is not allowed")
        try:
            req = json.loads(body)
            model = req["model"]
            stream = bool(req.get("stream"))
            include_usage = bool(stream and (req.get("stream_options") or {}).get("include_usage"))
        except (ValueError, TypeError, KeyError) as e:
            return _error(400, "invalid_request_error", f"bad request body: {e!r}")
        if model != MODEL:
            return _error(404, "model_not_found", f"the model {model!r} does not exist")
        key = (path, stream, include_usage, model)
        if (hit := self.cache.get(key)) is not None:
            return hit
        is_chat = path == "/v1/chat/completions"
        out = self._inference(is_chat, stream, include_usage, model)
        if len(self.cache) < MAX_CACHED:
            self.cache[key] = out
        return out

    def _inference(self, is_chat: bool, stream: bool, include_usage: bool, model: str) -> bytes:
        if is_chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        prefix = "chatcmpl" if is_chat else "cmpl"
        head = {"id": f"{prefix}-fake", "object": obj, "created": self.created, "model": model}
        finish = {"logprobs": None, "finish_reason": "stop", "stop_reason": None}
        if not stream:
            if is_chat:
                message = {"role": "assistant", "content": "".join(WORDS)}
                choice = {"index": 0, "message": message, **finish}
            else:
                choice = {"index": 0, "text": "".join(WORDS), **finish}
            return _response(200, _json({**head, "choices": [choice], "usage": USAGE}))

        def chunk(**choice: Any) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, **choice}]}

        events: list[Any] = []
        if is_chat:
            role = {"role": "assistant", "content": ""}
            events.append(chunk(delta=role, logprobs=None, finish_reason=None))
            events += [
                chunk(delta={"content": w}, logprobs=None, finish_reason=None) for w in WORDS
            ]
            events.append({**chunk(delta={}, **finish), "usage": USAGE})
        else:
            events += [chunk(text=w, logprobs=None, finish_reason=None) for w in WORDS]
            events.append({**chunk(text="", **finish), "usage": USAGE})
        if include_usage:
            events.append({**head, "choices": [], "usage": USAGE})
        events.append(b"[DONE]")
        return _sse_response(events)


class _Connection(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and pipelining; bodies by content-length or chunked."""

    def __init__(self, node: FakeNode) -> None:
        self.node = node
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None and not self.transport.is_closing():
            request = self._take_request()
            if request is None:
                return
            method, path, body, close = request
            self.transport.write(self.node.answer(method, path, body))
            if close:
                self.transport.close()

    def _take_request(self) -> tuple[str, str, bytes, bool] | None:
        """The next whole request off the buffer, or None until more bytes arrive."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD_BYTES:
                self._refuse("request head too large")
            return None
        lines = self.buf[:end].decode("latin-1").split("\r\n")
        try:
            method, path, version = lines[0].split(" ")
        except ValueError:
            self._refuse(f"bad request line {lines[0][:100]!r}")
            return None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        start = end + 4
        if "chunked" in headers.get("transfer-encoding", ""):
            try:
                decoded = _dechunk(self.buf, start)
            except ValueError:
                self._refuse("bad chunked body")
                return None
            if decoded is None:
                return None
            body, stop = decoded
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._refuse("bad content-length")
                return None
            if length > MAX_BODY_BYTES:
                self._refuse(f"body of {length} bytes")
                return None
            if len(self.buf) < start + length:
                return None
            body, stop = bytes(self.buf[start : start + length]), start + length
        del self.buf[:stop]
        connection = headers.get("connection", "")
        close = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
        return method, path, body, close

    def _refuse(self, why: str) -> None:
        assert self.transport is not None
        self.transport.write(_error(400, "invalid_request_error", why))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def _dechunk(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked body from `buf[start:]`: (body, end offset), or None while incomplete."""
    body, pos = bytearray(), start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";")[0], 16)  # ValueError: the caller refuses
        if size == 0:  # then optional trailer lines, then an empty line
            end = eol if buf[eol : eol + 4] == b"\r\n\r\n" else buf.find(b"\r\n\r\n", eol)
            return None if end < 0 else (bytes(body), end + 4)
        if len(buf) < eol + 2 + size + 2:
            return None
        body += buf[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2


async def serve(host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    sock = socket.create_server((host, port), backlog=1024)
    port = sock.getsockname()[1]
    node = FakeNode(f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}")
    server = await loop.create_server(lambda: _Connection(node), sock=sock)
    print(f"fake node on http://{host}:{port} (pid {os.getpid()})", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=13131, help="port; 0 picks a free one")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
