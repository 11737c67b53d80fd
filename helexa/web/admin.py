"""The admin console at /admin (docs/admin.md): login, the gate every other
page passes, and the Fleet page. Models, Keys and Spend live beside it in admin_*.py.

Access: no password configured → every /admin page is a 404 saying the console is off.
Otherwise a server-side session behind an HttpOnly SameSite=Strict cookie (a row in the
gateway's database: a restart keeps it and every gateway on the database serves it); every
request that changes something carries the session's CSRF token (htmx sends it as
X-CSRF-Token from `<body hx-headers>`, plain forms as a hidden `csrf` field) or is refused
with 403.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from typing import Any

from litestar import Request, Response, Router, get, post
from litestar.contrib.jinja import JinjaTemplateEngine
from litestar.exceptions import HTTPException
from litestar.response import Redirect
from litestar.static_files import create_static_files_router
from litestar.template import TemplateConfig

from helexa.gateway.admin_auth import AdminSession, csrf_ok
from helexa.gateway.service import Gateway
from helexa.logs import event
from helexa.web.admin_bench import BENCH_HANDLERS
from helexa.web.admin_common import (
    PREFIX,
    STATIC_DIR,
    form_of,
    render,
    session_of,
    template_environment,
    text,
    wants_partial,
)
from helexa.web.admin_keys import KEY_HANDLERS
from helexa.web.admin_models import MODEL_HANDLERS
from helexa.web.admin_spend import SPEND_HANDLERS
from helexa.web.gateway_deps import gateway_of

log = logging.getLogger(__name__)

SESSION_COOKIE = "helexa_admin"
LOGIN_COOKIE = "helexa_admin_login"  # double-submit token for the login form itself
LOGIN_PATH = PREFIX + "/login"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'"
    ),
}


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _is_secure(request: Request) -> bool:
    return request.url.scheme == "https"


async def _session(request: Request) -> AdminSession | None:
    """The live login behind the request's cookie, from the database (off the loop)."""
    gateway = gateway_of(request)
    cookie = request.cookies.get(SESSION_COOKIE)
    return await asyncio.to_thread(gateway.console.logins.get, gateway.sessions, cookie)


async def _gate(request: Request) -> Response | None:
    """Before every /admin handler: console off → 404; no session → the login page;
    a state-changing request without the session's CSRF token → 403."""
    admin = gateway_of(request).console  # a hook: no injection here
    if not admin.password.enabled:
        return render(request, "disabled", status=404)
    if request.url.path == LOGIN_PATH:
        return None
    session = await _session(request)
    if session is None:
        if wants_partial(request):  # htmx follows this header with a full navigation
            return Response("", status_code=401, headers={"HX-Redirect": LOGIN_PATH})
        target = request.url.path if request.method in SAFE_METHODS else PREFIX
        return Redirect(f"{LOGIN_PATH}?next={target}", status_code=303)
    request.state.admin_session = session
    if request.method not in SAFE_METHODS:
        sent = request.headers.get("x-csrf-token")
        if not sent:
            sent = text(await form_of(request), "csrf")
        if not csrf_ok(session, sent):
            event(
                log, logging.WARNING, "admin request refused: bad CSRF token", path=request.url.path
            )
            return render(
                request,
                "error",
                status=403,
                message="This form's security token is missing or out of date. "
                "Reload the page and try again.",
            )
    return None


def _secure_headers(response: Response) -> Response:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def _error_page(request: Request, exc: Exception) -> Response:
    """Admin pages answer errors with a page, never a stack trace or a JSON envelope."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status >= 500:
        log.exception("admin page failed: %s", request.url.path, exc_info=exc)
        message = "Something went wrong on the gateway; the log has the details."
    else:
        message = exc.detail if isinstance(exc, HTTPException) else str(exc)
    return render(request, "error", status=status, message=message)


# -- login -------------------------------------------------------------------------------


def _safe_next(target: str | None) -> str:
    """Only a path inside the console: never an open redirect."""
    if target and target.startswith(PREFIX + "/") and not target.startswith("//"):
        return target
    return PREFIX + "/fleet"


def _login_page(request: Request, status: int = 200, error: str | None = None) -> Response:
    token = secrets.token_urlsafe(24)
    nxt = _safe_next(request.query_params.get("next"))
    response = render(request, "login", status=status, login_token=token, error=error, next=nxt)
    response.set_cookie(
        LOGIN_COOKIE,
        token,
        path=LOGIN_PATH,
        httponly=True,
        samesite="strict",
        secure=_is_secure(request),
        max_age=3600,
    )
    return response


@get("/login")
async def login_form(request: Request, gateway: Gateway) -> Response:
    if await _session(request):
        return Redirect(_safe_next(request.query_params.get("next")), status_code=303)
    return _login_page(request)


@post("/login")
async def login(request: Request, gateway: Gateway) -> Response:
    admin = gateway.console
    form = await form_of(request)
    expected = request.cookies.get(LOGIN_COOKIE) or ""
    sent = text(form, "csrf")
    if not expected or not hmac.compare_digest(expected.encode(), sent.encode()):
        return _login_page(request, 403, "The login form expired; please try again.")
    client = _client(request)
    wait = admin.throttle.wait_s(client)
    if wait > 0:
        return _login_page(request, 429, f"Too many wrong passwords; try again in {wait:.0f} s.")
    # scrypt takes ~50 ms: off the event loop
    if not await asyncio.to_thread(admin.password.check, form.get("password") or ""):
        admin.throttle.failed(client)
        event(log, logging.WARNING, "admin login failed", client=client)
        return _login_page(request, 401, "Wrong password.")
    admin.throttle.succeeded(client)
    session = await asyncio.to_thread(admin.logins.create, gateway.sessions)
    event(log, logging.INFO, "admin logged in", client=client)
    response = Redirect(_safe_next(text(form, "next")), status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        session.token,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=_is_secure(request),
        max_age=int(admin.logins.ttl_s),
    )
    response.delete_cookie(LOGIN_COOKIE, path=LOGIN_PATH)
    return response


@post("/logout")
async def logout(request: Request, gateway: Gateway) -> Response:
    token = session_of(request).token
    await asyncio.to_thread(gateway.console.logins.drop, gateway.sessions, token)
    response = Redirect(LOGIN_PATH, status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=PREFIX)
    return response


# -- fleet -------------------------------------------------------------------------------


@get("/")
async def home() -> Response:
    return Redirect(PREFIX + "/fleet", status_code=303)


def _fleet_context(gateway: Gateway) -> dict[str, Any]:
    now = time.time()
    nodes = []
    for node in sorted(gateway.fleet.nodes.values(), key=lambda n: n.name):
        devices = [
            {
                "name": d.get("name") or d.get("kind", "device"),
                "kind": d.get("kind", "cuda"),
                "index": d.get("index"),
                "total_mb": d.get("memory_total_mb"),
                "used_mb": None
                if d.get("memory_total_mb") is None or d.get("memory_free_mb") is None
                else d["memory_total_mb"] - d["memory_free_mb"],
                "utilization": d.get("utilization_percent"),
            }
            for d in node.devices
        ]
        models = [
            {
                "id": m.get("id", model_id),
                "status": m.get("status", "?"),
                "in_flight": m.get("in_flight", 0),
                "queue_depth": m.get("queue_depth", 0),
                "memory_mb": m.get("memory_mb"),
            }
            for model_id, m in sorted(node.models.items())
        ]
        seen = None if node.last_seen is None else max(0, round(now - node.last_seen))
        nodes.append(
            {
                "node": node,
                "devices": devices,
                "models": models,
                "downloads": _downloads(node.activation),
                "seen_s_ago": seen,
            }
        )
    return {"nodes": nodes, "num_up": sum(1 for n in nodes if n["node"].up)}


MIB = 1024 * 1024


def _downloads(activation: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The hub downloads a node's last /health reported in flight (node/fetching.py)."""
    out = []
    for d in (activation or {}).get("downloads") or []:
        if not isinstance(d, dict):
            continue
        total, done = int(d.get("bytes_total") or 0), int(d.get("bytes_done") or 0)
        out.append(
            {
                "model_id": d.get("model_id", "?"),
                "repo": d.get("repo", "?"),
                "done_mb": done // MIB,
                "total_mb": total // MIB,
                "percent": round(100 * done / total) if total else 0,
                "rate_mb_s": round((d.get("bytes_per_s") or 0) / MIB, 1),
                "eta_s": d.get("eta_s"),
            }
        )
    return out


@get("/fleet")
async def fleet_page(request: Request, gateway: Gateway) -> Response:
    return render(request, "fleet", **_fleet_context(gateway))


@get("/fleet/nodes")
async def fleet_nodes(request: Request, gateway: Gateway) -> Response:
    """The node cards alone: what the Fleet page polls every few seconds."""
    return render(request, "fleet", partial="fleet_nodes", **_fleet_context(gateway))


# -- wiring ------------------------------------------------------------------------------


def admin_router() -> Router:
    return Router(
        PREFIX,
        route_handlers=[
            home,
            login_form,
            login,
            logout,
            fleet_page,
            fleet_nodes,
            *MODEL_HANDLERS,
            *KEY_HANDLERS,
            *SPEND_HANDLERS,
            *BENCH_HANDLERS,
        ],
        before_request=_gate,
        after_request=_secure_headers,
        exception_handlers={Exception: _error_page},
        include_in_schema=False,
    )


def admin_static() -> Router:
    """htmx and the stylesheet, no login needed (the login page uses them)."""
    return create_static_files_router(
        PREFIX + "/static", directories=[STATIC_DIR], name="admin-static"
    )


def admin_templates() -> TemplateConfig:
    return TemplateConfig(engine=JinjaTemplateEngine.from_environment(template_environment()))
