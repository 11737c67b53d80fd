"""A model hub on loopback for the download tests: the routes `huggingface_hub` calls (a
repo's info with its files, a file's metadata by HEAD, its bytes by GET, ranges included),
serving repositories from memory, optionally behind a token and at a bounded rate.

Model hubs are out of reach here, and a mock of `huggingface_hub` would test nothing of how
helexa drives it: this is a real HTTP server that the real client talks to."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?/?$")
_FILE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None
    range: str | None = None


@dataclass
class Hub:
    """Repositories by id, each {file name: bytes}; `token`: what every request must carry
    (`Authorization: Bearer …`); `rate`: bytes per second of a file's body (None: as fast as
    it goes)."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # sizes the repo's listing states instead of the bytes' own ((repo, file) -> bytes): a
    # model too large for any machine, without holding it
    listed_sizes: dict[tuple[str, str], int] = field(default_factory=dict)
    token: str | None = None
    rate: float | None = None
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def add(self, repo: str, files: dict[str, bytes | str | Path]) -> None:
        """A repository's files: bytes, text, or a local file read now."""
        out = {}
        for name, value in files.items():
            if isinstance(value, Path):
                value = value.read_bytes()
            out[name] = value.encode() if isinstance(value, str) else value
        self.repos[repo] = out

    def add_dir(self, repo: str, root: Path) -> None:
        """A repository holding every file under `root` (names relative to it)."""
        self.add(repo, {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()})

    def downloads(self, ranged: bool = False) -> list[str]:
        """The file paths whose bodies were sent (GET), in order; `ranged`: a part of one
        (a GGUF's header read before a download) counts too."""
        return [
            r.path
            for r in self.requests
            if r.method == "GET" and "/resolve/" in r.path and (ranged or r.range is None)
        ]

    def start(self) -> Hub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- serving ---------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        auth = h.headers.get("Authorization")
        self.requests.append(Request("HEAD" if head else "GET", path, auth, h.headers.get("Range")))
        if self.token is not None and auth != f"Bearer {self.token}":
            return self._json(h, 401, {"error": "Invalid credentials in Authorization header"})
        if m := _INFO.match(path):
            return self._info(h, m["repo"], head)
        if m := _TREE.match(path):
            return self._tree(h, m["repo"], head)
        if m := _FILE.match(path):
            return self._file(h, m["repo"], m["path"], head)
        self._json(h, 404, {"error": "Not Found"})

    def _missing(self, h: BaseHTTPRequestHandler, repo: str) -> None:
        h.send_response(404)
        body = json.dumps({"error": "Repository not found"}).encode()
        h.send_header("X-Error-Code", "RepoNotFound")
        h.send_header("X-Error-Message", "Repository not found")
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _info(self, h: BaseHTTPRequestHandler, repo: str, head: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._missing(h, repo)
        siblings = [
            {"rfilename": name, "size": self._size(repo, name, data), "blobId": _etag(data)}
            for name, data in sorted(files.items())
        ]
        info = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}
        self._json(h, 200, info, head=head)

    def _tree(self, h: BaseHTTPRequestHandler, repo: str, head: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._missing(h, repo)
        tree = [
            {"type": "file", "path": name, "size": self._size(repo, name, data), "oid": _etag(data)}
            for name, data in sorted(files.items())
        ]
        self._json(h, 200, tree, head=head)

    def _size(self, repo: str, name: str, data: bytes) -> int:
        return self.listed_sizes.get((repo, name), len(data))

    def _file(self, h: BaseHTTPRequestHandler, repo: str, name: str, head: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._missing(h, repo)
        data = files.get(name)
        if data is None:
            h.send_response(404)
            h.send_header("X-Error-Code", "EntryNotFound")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        start, end = 0, len(data)
        ranged = (rng := h.headers.get("Range")) and (m := re.match(r"bytes=(\d+)-(\d*)", rng))
        if ranged:
            start = int(m[1])
            end = min(len(data), int(m[2]) + 1) if m[2] else len(data)
        body = data[start:end]
        h.send_response(206 if ranged else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{_etag(data)}"')
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Content-Type", "application/octet-stream")
        if ranged:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        step = 64 * 1024
        for i in range(0, len(body), step):
            h.wfile.write(body[i : i + step])
            if self.rate:
                time.sleep(min(step, len(body) - i) / self.rate)

    def _json(self, h: BaseHTTPRequestHandler, status: int, obj, *, head: bool = False) -> None:
        body = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
