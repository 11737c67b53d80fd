"""`helexa bench run` against servers that are not helexa. No llama-server or Ollama runs
here, so a small HTTP server the test starts answers the way they do: its build on
`/api/version` (Ollama) or `/props` (llama.cpp), streams without usage counts, or none of
it. (Against a real helexa node: tests/web/test_admin_console.py.)"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from helexa.bench import history as bh
from helexa.bench.harness import run


class Server(BaseHTTPRequestHandler):
    """An OpenAI-compatible server with `routes` for its build and no usage counts."""

    routes: ClassVar[dict[str, dict]] = {}  # each test's own subclass gets its own
    bodies: ClassVar[list[dict]] = []
    url: ClassVar[str] = ""

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "llama-3"}]})
        elif self.path in self.routes:
            self._json(200, self.routes[self.path])
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.bodies.append(body)
        if not body.get("stream"):
            self._json(200, {"choices": [{"message": {"content": "x"}}]})  # no usage
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"delta": {"content": f"w{i} "}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)  # a token at a time, as a server decodes
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server() -> Iterator[type[Server]]:
    handler = type("Handler", (Server,), {"routes": {}, "bodies": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    yield handler
    httpd.shutdown()
    httpd.server_close()


def bench(sessions, url: str, **kw) -> int:
    args = argparse.Namespace(
        target=url,
        target_name="other",
        scenario=["chat-128"],
        model=None,
        samples=None,
        quick=True,
        api_key=None,
        sha=None,
    )
    for k, v in kw.items():
        setattr(args, k, v)
    return asyncio.run(run(args, sessions))


@pytest.mark.parametrize(
    ("path", "body", "sha"),
    [
        ("/api/version", {"version": "0.5.7"}, "0.5.7"),
        ("/props", {"build_info": "b4567-abc"}, "b4567-abc"),
    ],
)
def test_a_servers_own_version_names_the_build(server, sessions, capsys, path, body, sha):
    server.routes[path] = body
    assert bench(sessions, server.url) == 0
    out = capsys.readouterr().out
    assert f"at build {sha}" in out
    assert "llama-3: the target reports no usage; prompt sizes are estimates" in out
    (series,) = bh.history(sessions)
    assert series.model == "llama-3" and series.latest.build == bh.Build(sha, False)
    # streamed chunks stand in for the missing usage: 16 tokens, a rate over their window
    sample = series.latest.medians
    assert sample["ttft_ms"] is not None and sample["decode_tok_s"] is not None
    last = server.bodies[-1]
    assert last["ignore_eos"] is True and last["stream_options"] == {"include_usage": True}
    assert bench(sessions, server.url) == 0
    assert "skip chat-128-quick · llama-3: 1 of 1 samples at" in capsys.readouterr().out


def test_a_server_without_a_build_files_under_unknown_or_the_sha_given(server, sessions, capsys):
    assert bench(sessions, server.url) == 0
    assert "samples are filed under 'unknown'" in capsys.readouterr().out
    assert bench(sessions, server.url, sha="b9999") == 0
    assert [v.build.sha for v in bh.history(sessions)[0].versions] == ["unknown", "b9999"]
    server.routes["/api/version"] = {"version": "0.6.0"}
    with pytest.raises(ValueError, match=r"--sha b9999: the target reports build 0\.6\.0"):
        bench(sessions, server.url, sha="b9999")


def test_an_unreachable_target_is_a_clear_error(sessions):
    with pytest.raises(ValueError, match="cannot reach the target"):
        bench(sessions, "http://127.0.0.1:9/v1")
