"""The packaged units run as written: ExecStart (through the packaged /usr/bin/helexa, its
venv linked to the test's), the units' Environment= with their paths moved into tmp, and a
NOTIFY_SOCKET this test listens on, as systemd's would. Each role says READY=1 when it
should, answers, and on SIGTERM says STOPPING=1 and exits 0."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

import helexa
from tests.web.node_proc import free_port

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


def unit_service(path: Path) -> dict[str, list[str]]:
    """The [Service] section's settings, each key with its values in order."""
    settings: dict[str, list[str]] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


@dataclass
class Notifications:
    """A datagram socket standing in for systemd's notify socket; records each message's
    assignments and the sender's pid (SCM_CREDENTIALS)."""

    path: Path
    sock: socket.socket = field(init=False)
    messages: list[tuple[int, dict[str, str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(self.path))

    def wait_for(self, key: str, proc: subprocess.Popen, timeout: float) -> tuple[int, dict]:
        """The first message (from now on) that carries `key`, read while `proc` lives."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(0.2)
            try:
                data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                if proc.poll() is not None:
                    raise AssertionError(f"exited with {proc.returncode} before {key}") from None
                continue
            pid = next(
                struct.unpack("3i", bytes(d[:12]))[0]
                for level, kind, d in ancdata
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
            )
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append((pid, fields))
            if key in fields:
                return pid, fields
        raise AssertionError(f"no {key} in {timeout}s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


@dataclass
class Service:
    proc: subprocess.Popen
    notes: Notifications
    log: Path

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        pid, _ = self.notes.wait_for("STOPPING", self.proc, STOP_TIMEOUT_S)
        assert pid == self.proc.pid
        return self.proc.wait(STOP_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notes.close()


@pytest.fixture(scope="module")
def service_root(rpm_root, tmp_path_factory) -> Path:
    """The unpacked RPM with its venv being this test run's (sys.prefix)."""
    root = tmp_path_factory.mktemp("service-root")
    shutil.copytree(rpm_root, root, symlinks=True, dirs_exist_ok=True)
    (root / "usr/lib/helexa/venv").symlink_to(sys.prefix)
    assert (Path(sys.prefix) / "bin/helexa").exists(), "the test venv has no helexa command"
    return root


def start_unit(root: Path, unit: str, tmp: Path, overrides: dict[str, str]) -> Service:
    """Run `unit`'s ExecStart as systemd would, its paths moved under `tmp`."""
    service = unit_service(root / "usr/lib/systemd/system" / unit)
    (exec_start,) = service["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/usr/bin/helexa"
    argv[0] = str(root / "usr/bin/helexa")
    (tmp / "etc").mkdir(parents=True)
    shutil.copy(root / "etc/helexa/helexa.toml", tmp / "etc/helexa.toml")
    moved = {
        "/etc/helexa/helexa.toml": str(tmp / "etc/helexa.toml"),
        "/var/lib/helexa": str(tmp / "state"),
        "/var/cache/helexa": str(tmp / "cache"),
    }
    env = {"PATH": os.environ["PATH"], "HF_HUB_OFFLINE": "1"}
    for line in service.get("Environment", []):
        for assignment in shlex.split(line):
            key, _, value = assignment.partition("=")
            for old, new in moved.items():
                value = value.replace(old, new)
            assert not value.startswith(("/etc/", "/var/")), f"{key}={value} not moved"
            env[key] = value
    notes = Notifications(tmp / "notify.sock")
    env |= {"NOTIFY_SOCKET": str(notes.path), "HELEXA_NODE_STATE_DIR": moved["/var/lib/helexa"]}
    env |= overrides
    log = tmp / f"{unit}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Service(proc, notes, log)


def test_gateway_unit_says_ready_with_its_url_answers_and_stops_cleanly(service_root, tmp_path):
    port, metrics_port = free_port(), free_port()
    gateway = start_unit(
        service_root,
        "helexa-gateway.service",
        tmp_path,
        {
            "HELEXA_GATEWAY_LISTEN": f"127.0.0.1:{port}",
            "HELEXA_GATEWAY_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
            # /health and /version stay open even where every API call needs a key
            "HELEXA_GATEWAY_REQUIRE_AUTH": "true",
        },
    )
    try:
        pid, ready = gateway.notes.wait_for("READY", gateway.proc, READY_TIMEOUT_S)
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{base}/health", timeout=10)
        version = httpx.get(f"{base}/version", timeout=10)
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)

        assert pid == gateway.proc.pid  # the wrapper exec'd: NotifyAccess=main hears it
        assert ready["READY"] == "1"
        assert f"http://127.0.0.1:{port}" in ready["STATUS"]
        assert health.status_code == 200 and "nodes" in health.json()
        assert version.status_code == 200
        body = version.json()
        assert set(body) == {"version", "git_sha", "git_dirty", "build_time", "python"}
        assert body["version"] == helexa.__version__
        assert metrics.status_code == 200
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
        assert gateway.stop() == 0, gateway.log.read_text()
    finally:
        gateway.kill()


def test_node_unit_says_ready_only_once_its_default_model_loaded(
    service_root, tmp_path, model_dirs
):
    port = free_port()
    tiny = str(model_dirs["tiny"])
    node = start_unit(
        service_root,
        "helexa-node.service",
        tmp_path,
        {
            "HELEXA_NODE_LISTEN": f"127.0.0.1:{port}",
            "HELEXA_NODE_DEFAULT_MODELS": tiny,
            "HELEXA_ENGINE_KV_CACHE_MEMORY_MB": "16",
            "HELEXA_ENGINE_NUM_THREADS": "1",
        },
    )
    try:
        pid, ready = node.notes.wait_for("READY", node.proc, READY_TIMEOUT_S)
        statuses = [m["STATUS"] for _, m in node.notes.messages if "STATUS" in m]
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)

        assert pid == node.proc.pid
        assert statuses[0] == f"loading {tiny} (1 of 1)"
        assert ready["STATUS"] == "1 of 1 default models loaded"
        assert health.status_code == 200
        assert health.json()["activation"]["completed"] == [tiny]
        assert node.stop() == 0, node.log.read_text()
    finally:
        node.kill()
