"""Real node processes for tests: `helexa serve --role node` on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.engine.tiny import make_tiny_model

READY_TIMEOUT_S = 120.0
# a hang guard, not a speed limit: each default model past the first loads in its own
# worker process (torch imported, the native kernels mapped), 7-18 s apiece on a loaded
# 2-core CI box, and a node with a dozen of them took past 120 s there
READY_TIMEOUT_PER_MODEL_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scripted_model(
    root: Path,
    script: str,
    name: str = "scripted",
    *,
    tokenizer_from: str = "SmolLM2-135M-Instruct",
    chat_template: str | None = None,
) -> Path:
    """A `helexa_scripted` model dir: it answers `script` (then eos) whatever the prompt.

    The tokenizer (and its chat template) comes from the fixture model `tokenizer_from`;
    `chat_template` names another fixture template file (`Qwen3.5-4B/Qwen3.5-4B.jinja`)
    to use instead."""
    from tests.conftest import FIXTURES_DIR

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    src = FIXTURES_DIR / "models" / tokenizer_from
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    if chat_template is not None:
        template = (FIXTURES_DIR / "models" / chat_template).read_text()
        (d / "chat_template.jinja").write_text(template)
    (d / "config.json").write_text(json.dumps({"model_type": "helexa_scripted", "script": script}))
    return d


def tiny_model(root: Path, family: str = "smollm2", **overrides) -> Path:
    """A tiny random HF-layout model (see tests/engine/tiny.py)."""
    model_dir, _ = make_tiny_model(family, root, **overrides)
    return model_dir


def _toml(value: object) -> str:
    """A value as TOML: inline tables and arrays of them too."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


@dataclass
class NodeProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    api_key: str | None = None  # sent as a Bearer token by client/get/post when set

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        kw["headers"] = {**self.auth, **kw.get("headers", {})}
        return httpx.Client(base_url=self.base_url, timeout=60, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        kw["headers"] = {**self.auth, **kw.get("headers", {})}
        return httpx.get(self.base_url + path, timeout=30, **kw)

    def post(self, path: str, body: object = None, **kw) -> httpx.Response:
        kw["headers"] = {**self.auth, **kw.get("headers", {})}
        return httpx.post(self.base_url + path, json=body, timeout=120, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_node(
    tmp: Path,
    models: list[str | Path | dict],
    *,
    node: dict | None = None,
    engine: dict | None = None,
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    sources: dict[str, dict] | None = None,
) -> NodeProcess:
    """Start a node serving `models` and wait until its default models are loaded;
    `sources`: [sources.NAME] tables by name."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    node_cfg = {
        "listen": f"127.0.0.1:{port}",
        "default_models": [m if isinstance(m, dict) else str(m) for m in models],
        "state_dir": str(tmp / "state"),
        "model_dirs": [tempfile.gettempdir()],  # where the tests' model dirs live
        **(node or {}),
    }
    # autotune off: each node process would time its quantized shapes anew (a second or
    # more a start); tests/engine/test_autotune.py covers it
    engine_cfg = {"kv_cache_memory_mb": 16, "num_threads": 1, "autotune": False, **(engine or {})}
    lines = ["[node]", *(f"{k} = {_toml(v)}" for k, v in node_cfg.items())]
    lines += ["[engine]", *(f"{k} = {_toml(v)}" for k, v in engine_cfg.items())]
    for name, table in (sources or {}).items():
        lines += [f"[sources.{name}]", *(f"{k} = {_toml(v)}" for k, v in table.items())]
    cfg = tmp / f"node-{port}.toml"
    cfg.write_text("\n".join(lines) + "\n")
    log_path = tmp / f"node-{port}.log"
    proc_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc_env.pop("HELEXA_CONFIG", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "helexa.cli", "serve", "--role", "node", "--config", str(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=proc_env,
        )
    node_proc = NodeProcess(proc, f"http://127.0.0.1:{port}", log_path, node_cfg.get("api_key"))
    if wait_ready:
        wait_ready_or_fail(
            node_proc, READY_TIMEOUT_S + READY_TIMEOUT_PER_MODEL_S * max(0, len(models) - 1)
        )
    return node_proc


def wait_ready_or_fail(node: NodeProcess, timeout: float = READY_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"node exited with {node.proc.returncode}:\n{node.log()}")
        try:
            health = httpx.get(node.base_url + "/health", timeout=5).json()
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        if health["activation"]["state"] == "ready":
            if health["activation"]["failed"]:
                raise RuntimeError(f"default models failed: {health['activation']['failed']}")
            return health
        time.sleep(0.2)
    node.stop(signal.SIGKILL)
    raise TimeoutError(f"node not ready in {timeout}s:\n{node.log()}")
