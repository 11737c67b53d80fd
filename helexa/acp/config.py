"""The endpoints `helexa acp` drives: a TOML file (helexa-acp.example.toml), or for one
endpoint the environment alone.

```toml
[[endpoints]]
name = "home"                       # the model picker's prefix when there are several
base_url = "http://gpu-box:31313/v1" # the API's root, `/v1` included
wire_api = "openai-chat"            # or "openai-responses", "anthropic-messages"
api_key_env = "HELEXA_API_KEY"      # or api_key = "…"; neither: no key sent
context_window = 32768              # optional: history is compacted to fit it
max_tokens = 8192                   # optional: each answer's cap
default_model = "qwen3-coder"       # optional: a new session's model
```

Without a file: `HELEXA_ACP_BASE_URL` (required), `HELEXA_ACP_API_KEY`,
`HELEXA_ACP_WIRE_API`, `HELEXA_ACP_MODEL`, `HELEXA_ACP_CONTEXT_WINDOW`,
`HELEXA_ACP_MAX_TOKENS`, `HELEXA_ACP_NAME`. Every problem is reported at once.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

WIRE_APIS = ("openai-chat", "openai-responses", "anthropic-messages")
ENDPOINT_KEYS = frozenset(
    {
        "name",
        "base_url",
        "wire_api",
        "api_key",
        "api_key_env",
        "context_window",
        "max_tokens",
        "default_model",
    }
)


class AcpConfigError(Exception):
    """Every problem in the endpoints' configuration, one per entry of `problems`."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}:\n{lines}")


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    base_url: str  # without a trailing slash
    wire_api: str
    api_key: str | None = None
    context_window: int | None = None
    max_tokens: int | None = None
    default_model: str | None = None


@dataclass(frozen=True, slots=True)
class AcpConfig:
    endpoints: tuple[Endpoint, ...]
    source: str  # the file read, or "environment"

    def endpoint(self, name: str) -> Endpoint | None:
        return next((e for e in self.endpoints if e.name == name), None)


def default_path(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CONFIG_HOME/helexa/acp.toml` (`~/.config/helexa/acp.toml`)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "helexa" / "acp.toml"


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> AcpConfig:
    """The endpoints from `path` (or the default file when it exists), else from the
    environment. AcpConfigError names every problem."""
    env = os.environ if env is None else env
    if path is None:
        candidate = Path(env["HELEXA_ACP_CONFIG"]) if env.get("HELEXA_ACP_CONFIG") else None
        path = candidate or (default_path(env) if default_path(env).is_file() else None)
    if path is None:
        return _from_env(env)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise AcpConfigError(str(path), [f"cannot be read: {e.strerror or e}"]) from None
    except tomllib.TOMLDecodeError as e:
        raise AcpConfigError(str(path), [f"is not valid TOML: {e}"]) from None
    return _from_toml(str(path), data, env)


def _from_toml(source: str, data: dict[str, Any], env: Mapping[str, str]) -> AcpConfig:
    problems: list[str] = []
    unknown = sorted(set(data) - {"endpoints"})
    if unknown:
        problems.append(f"unknown key(s) {', '.join(unknown)}: expected [[endpoints]] tables")
    raw = data.get("endpoints")
    if not isinstance(raw, list) or not raw:
        problems.append("no [[endpoints]]: name at least one endpoint")
        raise AcpConfigError(source, problems)
    endpoints = []
    for i, table in enumerate(raw):
        where = f"endpoints[{i}]"
        if not isinstance(table, dict):
            problems.append(f"{where}: expected a table")
            continue
        endpoint = _endpoint(where, table, env, problems)
        if endpoint is not None:
            endpoints.append(endpoint)
    names = [e.name for e in endpoints]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"endpoint name {name!r} is used more than once")
    if problems:
        raise AcpConfigError(source, problems)
    return AcpConfig(tuple(endpoints), source)


def _endpoint(
    where: str, table: dict[str, Any], env: Mapping[str, str], problems: list[str]
) -> Endpoint | None:
    before = len(problems)
    for key in sorted(set(table) - ENDPOINT_KEYS):
        problems.append(f"{where}: unknown key {key!r} (known: {', '.join(sorted(ENDPOINT_KEYS))})")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip() or ":" in name:
        problems.append(f"{where}.name: expected a name without ':', got {name!r}")
    base_url = _base_url(f"{where}.base_url", table.get("base_url"), problems)
    wire_api = table.get("wire_api", "openai-chat")
    if wire_api not in WIRE_APIS:
        problems.append(
            f"{where}.wire_api: expected one of {', '.join(WIRE_APIS)}, got {wire_api!r}"
        )
    api_key = table.get("api_key")
    key_env = table.get("api_key_env")
    if api_key is not None and key_env is not None:
        problems.append(f"{where}: set api_key or api_key_env, not both")
    if api_key is not None and not isinstance(api_key, str):
        problems.append(f"{where}.api_key: expected a string")
    if key_env is not None:
        if not isinstance(key_env, str) or not key_env:
            problems.append(f"{where}.api_key_env: expected an environment variable's name")
        elif not env.get(key_env):
            problems.append(f"{where}.api_key_env: {key_env} is not set in the environment")
        else:
            api_key = env[key_env]
    counts = {
        k: _positive(f"{where}.{k}", table.get(k), problems)
        for k in ("context_window", "max_tokens")
    }
    default_model = table.get("default_model")
    if default_model is not None and (not isinstance(default_model, str) or not default_model):
        problems.append(f"{where}.default_model: expected a model id")
    if len(problems) > before:
        return None
    return Endpoint(
        name.strip(), base_url or "", wire_api, api_key or None,
        counts["context_window"], counts["max_tokens"], default_model,
    )  # fmt: skip


def _from_env(env: Mapping[str, str]) -> AcpConfig:
    problems: list[str] = []
    if not env.get("HELEXA_ACP_BASE_URL"):
        problems.append(
            "no endpoint: write ~/.config/helexa/acp.toml (see helexa-acp.example.toml) or set "
            "HELEXA_ACP_BASE_URL (e.g. http://127.0.0.1:31313/v1 for a local helexa gateway)"
        )
        raise AcpConfigError("environment", problems)
    table: dict[str, Any] = {
        "name": env.get("HELEXA_ACP_NAME") or "default",
        "base_url": env["HELEXA_ACP_BASE_URL"],
        "wire_api": env.get("HELEXA_ACP_WIRE_API") or "openai-chat",
    }
    if env.get("HELEXA_ACP_API_KEY"):
        table["api_key"] = env["HELEXA_ACP_API_KEY"]
    if env.get("HELEXA_ACP_MODEL"):
        table["default_model"] = env["HELEXA_ACP_MODEL"]
    for key, var in (
        ("context_window", "HELEXA_ACP_CONTEXT_WINDOW"),
        ("max_tokens", "HELEXA_ACP_MAX_TOKENS"),
    ):
        if env.get(var):
            try:
                table[key] = int(env[var])
            except ValueError:
                problems.append(f"{var}: expected a whole number, got {env[var]!r}")
    endpoint = _endpoint("environment", table, env, problems)
    if problems or endpoint is None:
        raise AcpConfigError("environment", problems)
    return AcpConfig((endpoint,), "environment")


def _base_url(where: str, value: Any, problems: list[str]) -> str | None:
    if not isinstance(value, str) or not value:
        problems.append(f"{where}: expected the API's root URL (e.g. http://host:8080/v1)")
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        problems.append(f"{where}: expected an http(s) URL, got {value!r}")
        return None
    return value.rstrip("/")


def _positive(where: str, value: Any, problems: list[str]) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"{where}: expected a positive whole number, got {value!r}")
        return None
    return value


def model_selector(endpoints: tuple[Endpoint, ...], endpoint: str, model: str) -> str:
    """The model picker's id of a model: bare with one endpoint, `endpoint:model` with
    several."""
    return model if len(endpoints) == 1 else f"{endpoint}:{model}"


def parse_selector(endpoints: tuple[Endpoint, ...], selector: str) -> tuple[Endpoint, str]:
    """The endpoint and model a picker id names; ValueError when it names neither."""
    if len(endpoints) == 1 and not _prefixed(endpoints, selector):
        return endpoints[0], selector
    name, sep, model = selector.partition(":")
    endpoint = next((e for e in endpoints if e.name == name), None)
    if not sep or endpoint is None or not model:
        known = ", ".join(e.name for e in endpoints)
        raise ValueError(f"model {selector!r} names no endpoint: expected endpoint:model ({known})")
    return endpoint, model


def _prefixed(endpoints: tuple[Endpoint, ...], selector: str) -> bool:
    name, sep, model = selector.partition(":")
    return bool(sep and model) and any(e.name == name for e in endpoints)
