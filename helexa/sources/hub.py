"""A hub as a download uses it (`HubSource`), from `[sources.NAME]` and the environment, and
which hub and repository a model id names (`split_ref`).

Where a setting comes from, first found wins (docs/node.md § Where models come from):
  - endpoint: the table's `endpoint`; for `huggingface`, else $HF_ENDPOINT, else
    https://huggingface.co. Any other source must state its endpoint.
  - token: the table's `token`, else the variable its `token_env` names (`huggingface`:
    HF_TOKEN by default); for `huggingface` only, else huggingface_hub's own stored login
    (`hf auth login`). Another source with neither sends no token at all: a Hugging Face
    token is never handed to another hub.
  - cache_dir: the table's `cache_dir`; for `huggingface`, else $HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub; another source, else
    <state_dir>/hub/<name> (two hubs may hold the same `org/name`: their files never mix).
  - offline: the table's `offline`, else $HF_HUB_OFFLINE: only what the cache holds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

HF = "huggingface"
HF_ALIASES = ("hf",)  # `hf:org/name` names the huggingface source too
HF_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "true", "yes", "on"}
# `scheme:org/name` or `org/name`: the part before the colon is a source's name
_REF = re.compile(r"^(?:(?P<scheme>[a-z0-9][a-z0-9_-]*):)?(?P<repo>[^/:\s]+/[^/:\s]+)$")


@dataclass(frozen=True, slots=True)
class HubSource:
    """One hub as downloads reach it; every field resolved (see the module's docstring)."""

    name: str
    endpoint: str
    cache_dir: Path
    token: str | None = field(default=None, repr=False)
    offline: bool = False

    @property
    def is_hf(self) -> bool:
        return self.name == HF

    def client_token(self) -> str | bool | None:
        """What huggingface_hub's `token=` takes: this source's token; for huggingface
        without one, None (the library's stored login); another hub without one, False (no
        token sent)."""
        if self.token:
            return self.token
        return None if self.is_hf else False

    def scrub(self, text: str) -> str:
        """`text` with this source's token masked: errors and logs never carry it."""
        return text.replace(self.token, "***") if self.token else text


def hf_cache_dir(env: Mapping[str, str]) -> Path:
    """The Hugging Face cache as huggingface_hub finds it: $HF_HUB_CACHE, $HF_HOME/hub,
    ~/.cache/huggingface/hub."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def env_offline(env: Mapping[str, str]) -> bool:
    return env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_source(
    name: str,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    token_env: str | None = None,
    cache_dir: Path | None = None,
    offline: bool | None = None,
    state_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> HubSource:
    """A source from its table's keys (None: unset) and the environment, in the module's
    order. ValueError where a source other than huggingface has no endpoint."""
    env = os.environ if env is None else env
    hf = name == HF
    if endpoint is None and hf:
        endpoint = env.get("HF_ENDPOINT") or HF_ENDPOINT
    if not endpoint:
        raise ValueError(f"[sources.{name}] endpoint: required for a source other than {HF!r}")
    if token is None and token_env:
        token = env.get(token_env) or None
    if cache_dir is None:
        base = state_dir if state_dir is not None else Path.home() / ".cache" / "helexa"
        cache_dir = hf_cache_dir(env) if hf else base / "hub" / name
    return HubSource(
        name=name,
        endpoint=endpoint.rstrip("/"),
        cache_dir=Path(cache_dir).expanduser(),
        token=token,
        offline=env_offline(env) if offline is None else offline,
    )


def default_source(env: Mapping[str, str] | None = None) -> HubSource:
    """The Hugging Face hub as the environment alone sets it (`LLM(...)`, no config)."""
    return resolve_source(HF, token_env="HF_TOKEN", env=env)


@dataclass(frozen=True, slots=True)
class HubRef:
    """A model id that names a hub repository: which source, which `org/name`."""

    source: str
    repo_id: str

    def __str__(self) -> str:
        return f"{self.source}:{self.repo_id}"


def split_ref(ref: str, default: str = HF) -> HubRef | None:
    """The hub repository `ref` names (`NAME:org/name`, or bare `org/name` on `default`);
    None when it is not a hub id (a path, the bundled model's name)."""
    m = _REF.match(ref)
    if m is None or ref.startswith((".", "~")):
        return None
    scheme = m["scheme"] or default
    return HubRef(HF if scheme in HF_ALIASES else scheme, m["repo"])
