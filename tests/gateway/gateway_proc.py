"""A real gateway process in front of real node processes, for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.web.node_proc import NodeProcess, free_port


@dataclass
class GatewayProcess(NodeProcess):
    metrics_url: str = ""
    database_url: str = ""

    def models(self) -> dict[str, dict]:
        return {m["id"]: m for m in self.get("/v1/models").json()["data"]}


def _toml_value(v: object) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return str(v).lower() if isinstance(v, bool) else json.dumps(v)


def start_gateway(
    tmp: Path,
    nodes: dict[str, NodeProcess | str],
    *,
    models: list[dict] | None = None,
    aliases: dict[str, str] | None = None,
    poll_interval_s: float = 0.3,
    wait_up: bool = True,
    gateway: dict | None = None,
    node: dict | None = None,
    admin: dict | None = None,
    http: dict | None = None,
    node_entries: dict[str, dict] | None = None,
    env: dict[str, str] | None = None,
) -> GatewayProcess:
    """Start `helexa serve --role gateway` and wait until it answers and (with `wait_up`)
    sees every node up. A node is a running NodeProcess or just a base URL; `node_entries`
    adds keys to a node's [[nodes]] entry (`api_key`, `api_key_env`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    port, mport = free_port(), free_port()
    lines = [
        "[node]",
        f"state_dir = {json.dumps(str(tmp / 'gw-state'))}",
        *(f"{k} = {_toml_value(v)}" for k, v in (node or {}).items()),
        "[gateway]",
        f'listen = "127.0.0.1:{port}"',
        f'metrics_listen = "127.0.0.1:{mport}"',
        f"poll_interval_s = {poll_interval_s}",
        *(f"{k} = {_toml_value(v)}" for k, v in (gateway or {}).items()),
    ]
    for name, node in nodes.items():
        url = node if isinstance(node, str) else node.base_url
        lines += ["[[nodes]]", f'name = "{name}"', f'endpoint = "{url}"']
        lines += [f"{k} = {_toml_value(v)}" for k, v in (node_entries or {}).get(name, {}).items()]
    for entry in models or []:
        lines += ["[[models]]", *(f"{k} = {_toml_value(v)}" for k, v in entry.items())]
    lines += ["[admin]", *(f"{k} = {_toml_value(v)}" for k, v in (admin or {}).items())]
    lines += ["[http]", *(f"{k} = {_toml_value(v)}" for k, v in (http or {}).items())]
    lines += [
        "[aliases]",
        *(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in (aliases or {}).items()),
    ]
    cfg = tmp / f"gateway-{port}.toml"
    cfg.write_text("\n".join(lines) + "\n")
    log_path = tmp / f"gateway-{port}.log"
    env = {**os.environ, **(env or {})}
    env.pop("HELEXA_CONFIG", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "helexa.cli",
                "serve",
                "--role",
                "gateway",
                "--config",
                str(cfg),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    gw = GatewayProcess(
        proc,
        f"http://127.0.0.1:{port}",
        log_path,
        metrics_url=f"http://127.0.0.1:{mport}",
        database_url=(gateway or {}).get("database_url")
        or f"sqlite:///{tmp / 'gw-state' / 'helexa.db'}",
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}:\n{gw.log()}")
        try:
            health = httpx.get(gw.base_url + "/health", timeout=5).json()
            if not wait_up or health["nodes_up"] == len(nodes):
                return gw
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    gw.stop()
    raise TimeoutError(f"gateway did not see its nodes:\n{gw.log()}")
