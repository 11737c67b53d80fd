"""The gateway's HTTP surface (SPEC "Gateway"): one OpenAI (and Anthropic) API over the
fleet, and the Prometheus app on its own port. Handlers are thin; decisions live in
`helexa.gateway`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from litestar import Litestar, Request, get, head, post
from litestar.exceptions import HTTPException
from litestar.response import Response, Stream
from sqlalchemy.orm import Session, sessionmaker

from helexa.config import Config
from helexa.db.seed import load_catalogue, seed_catalogue
from helexa.db.session import open_database
from helexa.errors import HelexaError, invalid_request
from helexa.gateway.accounting import Accountant
from helexa.gateway.auth import Authenticator
from helexa.gateway.budgets import Budgets
from helexa.gateway.catalogue import model_list, nodes_view
from helexa.gateway.fleet import Fleet
from helexa.gateway.keys import KeyStore
from helexa.gateway.ledger import Ledger
from helexa.gateway.metrics import GatewayMetrics
from helexa.gateway.model_jobs import ModelJobs
from helexa.gateway.poller import NodeCalls, Poller
from helexa.gateway.proxy import Upstream, warn
from helexa.gateway.router import Router
from helexa.logs import event
from helexa.web.admin import admin_router, admin_static, admin_templates
from helexa.web.admin_common import AdminState
from helexa.web.common import (
    METRICS_CONTENT_TYPE,
    error_response,
    parse_json_body,
)
from helexa.web.gateway_anthropic import (
    anthropic_error_response,
    count_tokens,
    is_anthropic_path,
    messages,
)
from helexa.web.gateway_asgi import Cors, GatewayASGI
from helexa.web.gateway_exchange import open_exchange

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class GatewayState:
    cfg: Config
    fleet: Fleet
    metrics: GatewayMetrics
    router: Router | None = None
    upstream: Upstream | None = None
    poller: Poller | None = None
    auth: Authenticator | None = None
    budgets: Budgets | None = None
    sessions: sessionmaker[Session] | None = None  # the database (admin console, keys)
    keys: KeyStore | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))


def _gw(request: Request) -> GatewayState:
    return request.app.state.gateway


def _body_object(raw: bytes) -> dict[str, Any]:
    body = parse_json_body(raw, _decoder.decode)
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("model: expected a non-empty string", "model")
    return body


async def _proxy(request: Request, path: str) -> Response:
    gw = _gw(request)
    assert gw.upstream is not None and gw.auth is not None
    principal = await gw.auth.authenticate(request.headers)
    raw = await request.body()
    ex, resp, headers = await open_exchange(request, principal, path, _body_object(raw), raw)
    # Litestar adds "; charset=utf-8" to text types itself: pass the bare type, not a double
    media_type = resp.headers.get("Content-Type", "application/json")
    if media_type.startswith("text/"):
        media_type = media_type.split(";", 1)[0]
    if media_type.startswith("text/event-stream"):
        return Stream(
            gw.upstream.relay(ex, resp),
            status_code=resp.status,
            headers=headers,
            media_type=media_type,
        )
    data = await gw.upstream.read(ex, resp)
    if resp.status >= 400:
        assert ex.route is not None
        warn(
            "upstream error",
            ex.route,
            path,
            status=resp.status,
            body=data[:500].decode("utf-8", "replace"),
        )
    return Response(content=data, status_code=resp.status, headers=headers, media_type=media_type)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    return await _proxy(request, "/v1/chat/completions")


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    return await _proxy(request, "/v1/completions")


@post("/v1/responses", status_code=200)
async def responses(request: Request) -> Response:
    return await _proxy(request, "/v1/responses")


@get("/v1/models")
async def v1_models(request: Request) -> dict[str, Any]:
    gw = _gw(request)
    assert gw.router is not None and gw.auth is not None
    principal = await gw.auth.authenticate(request.headers)
    models = model_list(gw.router, gw.started_at)
    if principal.key is not None and principal.key.allowed_models is not None:
        key = principal.key
        models = [m for m in models if key.allows(m["id"]) or key.allows(m.get("alias_of", ""))]
    return {"object": "list", "data": models}


@get("/")
async def root() -> dict[str, Any]:
    """What this is, for a person or a client probing the base URL."""
    return {"name": "helexa", "role": "gateway", "api": "/v1", "admin": "/admin"}


@head("/")
async def root_head() -> None:
    """Claude Code sends `HEAD /` before each session."""


@get("/health")
async def health(request: Request) -> dict[str, Any]:
    gw = _gw(request)
    up = gw.fleet.up()
    return {
        "status": "ok" if up else "degraded",
        "nodes": nodes_view(list(gw.fleet.nodes.values())),
        "nodes_up": len(up),
        "budget_reserved_tokens": gw.budgets.outstanding()[0] if gw.budgets else 0,
    }


@get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(content=request.app.state.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def create_gateway_apps(cfg: Config) -> tuple[GatewayASGI, Litestar]:
    """The API app and the metrics app; they share one fleet picture."""
    _warn_about_node_keys(cfg)
    fleet = Fleet([(n.name, n.endpoint) for n in cfg.nodes], {n.name: n.api_key for n in cfg.nodes})
    gw = GatewayState(cfg, fleet, GatewayMetrics(fleet))
    max_body_bytes = cfg.http.max_body_mb << 20
    admin = AdminState.from_config(cfg.admin)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            _engine, sessions = await asyncio.to_thread(open_database, cfg)
            with sessions() as db:
                if seed_catalogue(db, cfg):
                    log.info("catalogue seeded from the config: %d models", len(cfg.models))
                catalogue, aliases = load_catalogue(db)
            gw.sessions, gw.keys = sessions, KeyStore(sessions)
            gw.auth = Authenticator(gw.keys, require_auth=cfg.gateway.require_auth)
            gw.poller = Poller(fleet, session, cfg.gateway.poll_interval_s)
            gw.router = Router(cfg, fleet, NodeCalls(session, gw.poller))
            gw.router.replace_catalogue(catalogue, aliases)
            admin.jobs = ModelJobs(gw.router)
            gw.budgets = Budgets(sessions)
            ledger = Ledger(sessions)
            accountant = Accountant(gw.budgets, ledger, gw.metrics)
            gw.upstream = Upstream(session, gw.router, gw.metrics, accountant)
            ledger.start()
            gw.poller.start()
            try:
                yield
            finally:
                await gw.poller.stop()
                await ledger.close()  # every pending row is written before we exit

    def handle(request: Request, exc: Exception) -> Response:
        exc = _as_client_error(request, exc, cfg.http.max_body_mb)
        if isinstance(exc, HelexaError):
            event(
                log,
                logging.WARNING,
                "request refused",
                path=request.url.path,
                status=exc.status,
                code=exc.code,
                error=exc.message,
            )
        if is_anthropic_path(request.url.path):
            return anthropic_error_response(request, exc)
        return error_response(request, exc)

    api = Litestar(
        route_handlers=[
            chat_completions,
            completions,
            responses,
            messages,
            count_tokens,
            v1_models,
            health,
            root,
            root_head,
            admin_router(),
            admin_static(),
        ],
        template_config=admin_templates(),
        exception_handlers={Exception: handle},
        lifespan=[lifespan],
        request_max_body_size=max_body_bytes,
        openapi_config=None,
        logging_config=None,
    )
    api.state.gateway = gw
    api.state.admin = admin
    metrics_app = Litestar(
        route_handlers=[metrics],
        openapi_config=None,
        logging_config=None,
        exception_handlers={Exception: error_response},
    )
    metrics_app.state.metrics = gw.metrics
    cors = Cors(cfg.gateway.cors_allow_origins) if cfg.gateway.cors_allow_origins else None
    return GatewayASGI(api, gw, cors), metrics_app


def _as_client_error(request: Request, exc: Exception, max_body_mb: int) -> Exception:
    """The gateway's own wording for a body over the limit, and for a node's answer that
    broke off while we read it (its wire detail goes to the log only)."""
    if isinstance(exc, HTTPException) and exc.status_code == 413:
        return HelexaError(
            413,
            "invalid_request_error",
            f"the request body is larger than {max_body_mb} MiB, the gateway's limit "
            "([http] max_body_mb)",
            code="request_too_large",
        )
    if isinstance(exc, aiohttp.ClientError | TimeoutError):
        event(log, logging.WARNING, "node answer failed", path=request.url.path, error=repr(exc))
        return HelexaError(
            502, "server_error", "the node's answer broke off; retry", code="upstream_error"
        )
    return exc


def _warn_about_node_keys(cfg: Config) -> None:
    """Say at start what would otherwise show up only as nodes refusing the gateway."""
    if cfg.node.gateway_secret:
        log.warning(
            "[node] gateway_secret is deprecated and will be removed in the next release: it "
            "is read as [node] api_key (the key the gateway sends its nodes); rename it"
        )
    for n in cfg.nodes:
        if n.api_key is None and n.api_key_env:
            log.warning(
                "node %s: api_key_env %s is not set; calls to it carry no key",
                n.name,
                n.api_key_env,
            )
