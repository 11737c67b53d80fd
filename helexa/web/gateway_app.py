"""The gateway's HTTP surface (SPEC "Gateway"): one OpenAI API over the fleet, and the
Prometheus app on its own port. Handlers are thin; decisions live in `helexa.gateway`."""

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
from litestar import Litestar, Request, get, post
from litestar.response import Response, Stream

from helexa.config import Config
from helexa.db.seed import load_catalogue, seed_catalogue
from helexa.db.session import open_database
from helexa.errors import HelexaError, invalid_request, model_not_found
from helexa.gateway.accounting import Accountant
from helexa.gateway.auth import Authenticator, Principal
from helexa.gateway.budgets import Budgets, estimate_prompt_tokens
from helexa.gateway.catalogue import model_list, nodes_view
from helexa.gateway.edge import advice, check_context
from helexa.gateway.fleet import Fleet
from helexa.gateway.keys import KeyStore
from helexa.gateway.ledger import Ledger
from helexa.gateway.metrics import GatewayMetrics
from helexa.gateway.poller import NodeCalls, Poller
from helexa.gateway.proxy import Exchange, Upstream, forward_headers, response_headers, warn
from helexa.gateway.router import Route, Router
from helexa.logs import event
from helexa.web.common import (
    ACCOUNT_HEADER,
    BUDGET_HEADER,
    KEY_HEADER,
    MAX_BODY_BYTES,
    METRICS_CONTENT_TYPE,
    SECRET_HEADER,
    error_response,
    parse_json_body,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_OUTPUT = 8192  # the node's own default cap when nothing says otherwise
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


def _node_headers(gw: GatewayState, request: Request, principal: Principal) -> dict[str, str]:
    """The client's headers for the node: its key and any `x-helexa-*` claims removed, the
    authenticated principal stamped, with the shared node secret when one is set."""
    headers = forward_headers(request.headers)
    headers.pop("authorization", None)
    headers.pop("Authorization", None)
    if principal.key is not None:
        headers[ACCOUNT_HEADER] = principal.key.account_id
        headers[KEY_HEADER] = principal.key.id
    if gw.cfg.node.gateway_secret:
        headers[SECRET_HEADER] = gw.cfg.node.gateway_secret
    return headers


def _check_scope(gw: GatewayState, principal: Principal, model: str) -> None:
    """A key scoped to some models does not see the others: 404, as if they did not exist."""
    key = principal.key
    if key is not None and not (key.allows(model) or key.allows(gw.router.concrete(model))):
        raise model_not_found(model)


async def _proxy(request: Request, path: str) -> Response:
    gw = _gw(request)
    assert gw.router is not None and gw.upstream is not None and gw.auth is not None
    principal = await gw.auth.authenticate(request.headers)
    raw = await request.body()
    body = _body_object(raw)
    model = body["model"]
    _check_scope(gw, principal, model)
    routes = await gw.router.routes(model)
    context = _context_limit(routes)
    try:
        check_context(body, context)
    except HelexaError as e:
        hint = advice(request.headers.get("user-agent"), e, context)
        if hint:
            e.extra_headers = {"X-Helexa-Advice": hint}
        raise
    concrete = gw.router.concrete(model)
    entry = gw.router.catalogue.get(concrete)
    ex = Exchange(None, concrete, principal)
    ex.price = (entry.cost.input, entry.cost.output) if entry else (0.0, 0.0)
    rewrite = routes[0].model_id != model  # an alias, or a catalogue id known by source
    body["model"] = routes[0].model_id
    if principal.key is not None and principal.key.budget is not None:
        await _reserve(gw, ex, body, raw, routes[0])
        rewrite = True
    if rewrite:
        raw = _encoder.encode(body)
    headers = _node_headers(gw, request, principal)
    if ex.reservation is not None:  # the node enforces it against the real prompt length
        res = ex.reservation
        headers[BUDGET_HEADER] = (
            f"tokens={res.tokens}; cost={res.cost!r}; in={ex.price[0]!r}; out={ex.price[1]!r}"
        )
    try:
        route, resp = await gw.upstream.open(routes, path, raw, headers)
    except BaseException:
        gw.upstream.abandon(ex, 503)
        raise
    gw.router.begin(route)
    ex.route = route
    headers = response_headers(resp.headers)
    headers["x-helexa-node"] = route.node.name  # which replica answered
    # Litestar adds "; charset=utf-8" to text types itself: pass the bare type, not a double
    media_type = resp.headers.get("Content-Type", "application/json")
    if media_type.startswith("text/"):
        media_type = media_type.split(";", 1)[0]
    headers.pop("Content-Type", None)
    headers.pop("content-type", None)
    if media_type.startswith("text/event-stream"):
        return Stream(
            gw.upstream.relay(ex, resp),
            status_code=resp.status,
            headers=headers,
            media_type=media_type,
        )
    data = await gw.upstream.read(ex, resp)
    if resp.status >= 400:
        warn(
            "upstream error",
            route,
            path,
            status=resp.status,
            body=data[:500].decode("utf-8", "replace"),
        )
    return Response(content=data, status_code=resp.status, headers=headers, media_type=media_type)


def _context_limit(routes: list[Route]) -> int | None:
    """The smallest context any candidate replica advertises (None when none says)."""
    limits = [(r.node.models.get(r.model_id) or {}).get("limit", {}).get("context") for r in routes]
    known = [n for n in limits if isinstance(n, int)]
    return min(known) if known else None


async def _reserve(
    gw: GatewayState, ex: Exchange, body: dict[str, Any], raw: bytes, route: Route
) -> None:
    """Reserve the request's upper bound on its key's budget; its max_tokens becomes what
    the reservation covers, so the node can never generate past the cap."""
    key = ex.principal.key
    assert key is not None and gw.budgets is not None
    limit = (route.node.models.get(route.model_id) or {}).get("limit") or {}
    ex.prompt_estimate = estimate_prompt_tokens(raw)
    requested = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        requested = limit.get("output") or DEFAULT_MAX_OUTPUT
    if isinstance(limit.get("context"), int):
        requested = min(requested, max(1, limit["context"] - ex.prompt_estimate))
    ex.reservation = await gw.budgets.reserve(key, ex.prompt_estimate, requested, ex.price)
    if ex.reservation is not None:
        body["max_tokens"] = ex.reservation.max_output
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = ex.reservation.max_output


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


_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health"}


class CountedApp:
    """The API app wrapped so that `helexa_requests_total{route,code}` sees every request,
    unmatched paths (404) and refused methods (405) included."""

    def __init__(self, app: Litestar, gw: GatewayState) -> None:
        self.app = app
        self.gw = gw
        self.state = app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope["path"]
            route = path if path in _ROUTES else "other"  # bounded label values
            self.gw.metrics.requests.labels(route, str(status)).inc()


def create_gateway_apps(cfg: Config) -> tuple[CountedApp, Litestar]:
    """The API app and the metrics app; they share one fleet picture."""
    fleet = Fleet([(n.name, n.endpoint) for n in cfg.nodes])
    gw = GatewayState(cfg, fleet, GatewayMetrics(fleet))

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
            gw.auth = Authenticator(KeyStore(sessions), require_auth=cfg.gateway.require_auth)
            gw.poller = Poller(fleet, session, cfg.gateway.poll_interval_s)
            gw.router = Router(cfg, fleet, NodeCalls(session, gw.poller))
            gw.router.replace_catalogue(catalogue, aliases)
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
        return error_response(request, exc)

    api = Litestar(
        route_handlers=[chat_completions, completions, responses, v1_models, health],
        exception_handlers={Exception: handle},
        lifespan=[lifespan],
        request_max_body_size=MAX_BODY_BYTES,
        openapi_config=None,
        logging_config=None,
    )
    api.state.gateway = gw
    metrics_app = Litestar(
        route_handlers=[metrics],
        openapi_config=None,
        logging_config=None,
        exception_handlers={Exception: error_response},
    )
    metrics_app.state.metrics = gw.metrics
    return CountedApp(api, gw), metrics_app
