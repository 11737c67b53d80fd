"""Attacks on a node's access, run as an outsider would: no key, forged gateway headers,
paths outside the model directories, an open port. Real node processes throughout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.web.node_proc import free_port, start_node

KEY = "correct horse battery staple"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
# every route a caller can reach, with a body where it takes one
ROUTES = [
    ("GET", "/models", None),
    ("GET", "/v1/models", None),
    ("GET", "/discovery", None),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("GET", "/models/x/endpoint", None),
    ("GET", "/no/such/route", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/responses", {"input": "Hi"}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/models/load", {"model_id": "/etc"}),
    ("POST", "/models/unload", {"model_id": "x"}),
]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, scripted_id):
    node = start_node(tmp_path_factory.mktemp("keyed"), [scripted_id], node={"api_key": KEY})
    yield node
    node.stop()


def _call(node, method: str, path: str, body, headers: dict) -> httpx.Response:
    return httpx.request(method, node.base_url + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_every_route_but_health_refuses_a_caller_without_the_key(keyed, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = _call(keyed, method, path, body, headers)
        assert r.status_code == 401, (path, headers, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
        assert KEY not in r.text
        assert r.headers["www-authenticate"].startswith("Bearer")


def test_health_stays_open_and_the_key_opens_everything_else(keyed, scripted_id):
    assert httpx.get(keyed.base_url + "/health").status_code == 200
    r = keyed.post("/v1/chat/completions", {"model": scripted_id, **CHAT})
    assert r.status_code == 200, r.text
    assert keyed.get("/models").status_code == 200
    # the deprecated header an older gateway sends is still honoured for one release
    legacy = httpx.get(keyed.base_url + "/models", headers={"x-helexa-gateway-secret": KEY})
    assert legacy.status_code == 200


def test_loads_outside_the_model_dirs_are_refused_alike_whether_or_not_the_path_exists(
    keyed, tmp_path
):
    paths = ["/etc", "/etc/passwd", str(tmp_path / "missing"), "/nonexistent/model"]
    paths += ["../../etc", "relative/../../etc", "~/.ssh"]
    for path in paths:
        bare = httpx.post(keyed.base_url + "/models/load", json={"model_id": path}, timeout=30)
        assert bare.status_code == 401  # without the key nothing about the path is said
    answers = []
    # the key holder is refused too: these are not hub ids, nor under [node] model_dirs
    for path in ["/etc", "/etc/passwd", "/nonexistent/model", "../../etc", "~/.ssh"]:
        r = keyed.post("/models/load", {"model_id": path})
        assert r.status_code == 403, (path, r.text)
        error = r.json()["error"]
        assert error["code"] == "model_path_not_allowed"
        answers.append(error["message"].replace(repr(path), "<id>"))
    assert len(set(answers)) == 1, answers  # one message: existence is not revealed


def test_a_symlink_out_of_the_model_dirs_is_refused(tmp_path_factory, scripted_id):
    root = tmp_path_factory.mktemp("roots")
    (root / "models").mkdir()
    (root / "models" / "escape").symlink_to("/etc")
    node = start_node(
        root / "n", [scripted_id], node={"api_key": KEY, "model_dirs": [str(root / "models")]}
    )
    try:
        r = node.post("/models/load", {"model_id": str(root / "models" / "escape")})
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_path_not_allowed"
        inside = node.post("/models/load", {"model_id": str(root / "models" / "absent")})
        assert inside.status_code == 422  # allowed, then simply not found
        assert inside.json()["error"]["kind"] == "model_not_found"
    finally:
        node.stop()


def test_the_key_can_come_from_the_environment(tmp_path, scripted_id):
    node = start_node(tmp_path, [scripted_id], env={"HELEXA_NODE_API_KEY": KEY}, wait_ready=False)
    node.api_key = KEY
    try:
        from tests.web.node_proc import wait_ready_or_fail

        wait_ready_or_fail(node)
        assert httpx.get(node.base_url + "/models").status_code == 401
        assert node.get("/models").status_code == 200
    finally:
        node.stop()


def _serve(tmp_path, listen: str, extra: str = "") -> subprocess.Popen:
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        f'[node]\nlisten = "{listen}"\nstate_dir = "{tmp_path}/state"\n'
        f'default_models = ["{tmp_path}/none"]\n{extra}'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELEXA_")}
    return subprocess.Popen(
        [sys.executable, "-m", "helexa.cli", "serve", "--role", "node", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )


def test_an_open_node_beyond_loopback_refuses_to_start(tmp_path):
    proc = _serve(tmp_path, f"0.0.0.0:{free_port()}")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if "api_key" in line]
    assert len(lines) == 1 and "allow_unauthenticated" in lines[0], out


def test_allow_unauthenticated_starts_with_a_warning_at_start_and_in_discovery(tmp_path):
    port = free_port()
    proc = _serve(tmp_path, f"0.0.0.0:{port}", "allow_unauthenticated = true\n")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                found = httpx.get(f"http://127.0.0.1:{port}/discovery", timeout=5).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
                time.sleep(0.2)
        assert found["auth"] == "none"
        assert any("without authentication" in w for w in found["warnings"])
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(5)
    assert any("WARNING" in line and "api_key" in line for line in lines), "".join(lines)


def test_a_loopback_node_needs_no_key(tmp_path, scripted_id):
    node = start_node(tmp_path, [scripted_id])
    try:
        assert node.get("/models").status_code == 200
        assert node.get("/discovery").json()["warnings"] == []
    finally:
        node.stop()
