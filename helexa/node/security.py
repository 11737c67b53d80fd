"""Who may call a node, what it believes of them, and what it may be asked to load.

Pure rules, no HTTP: the web layer hands in headers, the peer's address and the config.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from helexa.config import NodeConfig
from helexa.errors import HelexaError, invalid_request
from helexa.node.admission import direct_caller
from helexa.protocol.wire import ACCOUNT_HEADER, BUDGET_HEADER, KEY_HEADER, VIA_HEADER, SpendBudget

# A hub id: `org/name`, optionally `scheme:org/name` ([sources.<scheme>]).
_HUB_ID = re.compile(r"(?:[a-z0-9][a-z0-9_-]*:)?[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_loopback(host: str) -> bool:
    """Whether a listen or peer address reaches only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, port: int, node: NodeConfig) -> str | None:
    """Why a node must not start listening on `host` (None: it may)."""
    if is_loopback(host) or node.api_key or node.allow_unauthenticated:
        return None
    return (
        f"refusing to serve {host}:{port} without authentication: anyone who can reach it "
        "could load and unload models and use them past the gateway. Set [node] api_key "
        "(or HELEXA_NODE_API_KEY) and give the gateway the same key, or set [node] "
        "allow_unauthenticated = true to serve it open anyway"
    )


def unauthenticated_warning(host: str, node: NodeConfig) -> str | None:
    """The warning an open, non-loopback node gives at start and in /discovery."""
    if node.api_key or is_loopback(host):
        return None
    return (
        "this node serves without authentication (allow_unauthenticated = true): anyone who "
        "can reach it can load, unload and use models; set [node] api_key"
    )


def key_matches(given: str | None, api_key: str) -> bool:
    """Constant-time comparison of a presented key with the node's."""
    return given is not None and hmac.compare_digest(given.encode(), api_key.encode())


def principal_of(headers: Mapping[str, str], trusted: bool, client: str | None) -> str | None:
    """Who is calling, for fair shares of the queue and the optional per-key cap:
    `account/key` as the gateway stamps it; None for the gateway's anonymous traffic (one
    share); anyone else is an anonymous direct caller, its share named by its address and
    never capped. `trusted`: whether the gateway's headers may be believed (NodeGuard
    decides)."""
    if trusted:
        account, key = headers.get(ACCOUNT_HEADER), headers.get(KEY_HEADER)
        if account or key:
            return f"{account or '-'}/{key or '-'}"
        if headers.get(VIA_HEADER):
            return None
    return direct_caller(client)


def budget_of(headers: Mapping[str, str], trusted: bool) -> SpendBudget | None:
    """The gateway's reservation for this request (`x-helexa-budget`), if a trusted caller
    sent one; a malformed one is the 400 naming the header."""
    value = headers.get(BUDGET_HEADER)
    if not value or not trusted:
        return None
    try:
        return SpendBudget.parse(value)
    except ValueError as e:
        raise invalid_request(f"{BUDGET_HEADER}: {e}", BUDGET_HEADER) from None


def model_path_not_allowed(model_id: str, param: str = "model_id") -> HelexaError:
    # One message whether or not the path exists: a refusal must not reveal the filesystem.
    return HelexaError(
        403,
        "permission_error",
        f"{param} {model_id!r} is neither a hub id (org/name) nor a path under this node's "
        "model directories ([node] model_dirs)",
        code="model_path_not_allowed",
        param=param,
    )


def loadable_ref(
    model_id: str,
    roots: Sequence[Path],
    bundled_id: str,
    param: str = "model_id",
    source: str = "huggingface",
) -> str:
    """What a `POST /models/load` of `model_id` may load: the bundled model's id, a hub id
    (returned with its source scheme, `source` for a bare `org/name`, so that it never
    resolves to a local directory), or
    an absolute path whose real location is inside one of `roots`; else the 403 naming
    `param` (the body's field: the model, or its draft model)."""
    if model_id == bundled_id:
        return model_id
    if _HUB_ID.fullmatch(model_id) and ".." not in model_id:
        return model_id if ":" in model_id else f"{source}:{model_id}"
    path = Path(model_id)
    if not path.is_absolute():
        raise model_path_not_allowed(model_id, param)
    real = Path(os.path.realpath(path))  # symlinks followed, missing parts kept
    for root in roots:
        base = Path(os.path.realpath(root))
        if real != base and real.is_relative_to(base):
            return str(real)
    raise model_path_not_allowed(model_id, param)
