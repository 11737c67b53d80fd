"""The gateway's HTTP surface (docs/gateway.md): one OpenAI (and Anthropic) API over the
fleet, and the Prometheus app on its own port. Handlers are thin; decisions live in
`helexa.gateway`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, get, head, post
from litestar.exceptions import HTTPException
from litestar.response import Response
from litestar.types import ASGIApp

from helexa.config import Config
from helexa.gateway.catalogue import model_list, nodes_view
from helexa.gateway.ledger import Ledger
from helexa.gateway.service import Gateway, build_gateway
from helexa.protocol.bodies import (
    ChatCompletion,
    ChatCompletionBody,
    ChatCompletionChunk,
    Completion,
    CompletionBody,
    ModelList,
    ResponseEvent,
    ResponseObject,
    ResponsesBody,
)
from helexa.version import build_info
from helexa.web.admin import admin_router, admin_static, admin_templates
from helexa.web.common import METRICS_CONTENT_TYPE, error_response
from helexa.web.gateway_anthropic import (
    anthropic_error_response,
    count_tokens,
    is_anthropic_path,
    messages,
)
from helexa.web.gateway_asgi import Cors, GatewayASGI
from helexa.web.gateway_deps import STATE_KEY, dependencies, gateway_of
from helexa.web.gateway_passthrough import Passthrough, client_error, too_large
from helexa.web.openapi import (
    API_KEY,
    API_KEY_SCHEME,
    BEARER,
    BEARER_SCHEME,
    PUBLIC,
    ApiDocument,
    wire,
)

log = logging.getLogger(__name__)

PASSTHROUGH_STATE = "helexa_passthrough"


def _passthrough(request: Request) -> ASGIApp:
    """What answers an OpenAI pass-through route: `GatewayASGI` sends these requests to it
    directly, and a request that comes through Litestar gets the same app."""
    return request.app.state[PASSTHROUGH_STATE]


@post(
    "/v1/chat/completions",
    status_code=200,
    opt=wire(ChatCompletionBody, ChatCompletion, events=ChatCompletionChunk),
)
async def chat_completions(request: Request) -> ASGIApp:
    return _passthrough(request)


@post("/v1/completions", status_code=200, opt=wire(CompletionBody, Completion, events=Completion))
async def completions(request: Request) -> ASGIApp:
    return _passthrough(request)


@post(
    "/v1/responses", status_code=200, opt=wire(ResponsesBody, ResponseObject, events=ResponseEvent)
)
async def responses(request: Request) -> ASGIApp:
    return _passthrough(request)


@get("/v1/models", opt=wire(answer=ModelList))
async def v1_models(request: Request, gateway: Gateway) -> dict[str, Any]:
    principal = await gateway.auth.authenticate(request.headers)
    models = model_list(gateway.router, gateway.started_at)
    if principal.key is not None and principal.key.allowed_models is not None:
        key = principal.key
        models = [m for m in models if key.allows(m["id"]) or key.allows(m.get("alias_of", ""))]
    return {"object": "list", "data": models}


@get("/", opt=PUBLIC)
async def root() -> dict[str, Any]:
    """What this is, for a person or a client probing the base URL."""
    return {"name": "helexa", "role": "gateway", "api": "/v1", "admin": "/admin"}


@head("/", opt=PUBLIC)
async def root_head() -> None:
    """Claude Code sends `HEAD /` before each session."""


@get("/health", opt=PUBLIC)
async def health(gateway: Gateway) -> dict[str, Any]:
    up = gateway.fleet.up()
    return {
        "status": "ok" if up else "degraded",
        "nodes": nodes_view(list(gateway.fleet.nodes.values())),
        "nodes_up": len(up),
        "budget_reserved_tokens": gateway.budgets.outstanding()[0],
        "books": books_view(gateway.ledger),
    }


@get("/version", opt=PUBLIC)
async def version() -> dict[str, Any]:
    """What is running: package version, git commit and dirty flag, build time, Python.
    Open to anyone, like /health (no torch here: the gateway never loads it)."""
    return build_info()


def books_view(ledger: Ledger) -> dict[str, Any]:
    """The books' writer: whether the database takes writes, and what waits for it."""
    state = ledger.state
    return {
        "database": "ok" if state.database_ok else "unavailable",
        "backlog": ledger.backlog,
        "backlog_max": ledger.backlog_max,
        "dropped": state.dropped,
        "last_error": state.last_error,
    }


@get("/metrics", media_type=METRICS_CONTENT_TYPE)
async def metrics(gateway: Gateway) -> Response:
    return Response(content=gateway.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def create_gateway_apps(cfg: Config) -> tuple[GatewayASGI, Litestar]:
    """The API app and the metrics app, over one gateway (built here, started by the API
    app's lifespan)."""
    gateway = build_gateway(cfg)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    api = Litestar(
        route_handlers=[
            chat_completions,
            completions,
            responses,
            messages,
            count_tokens,
            v1_models,
            health,
            version,
            root,
            root_head,
            admin_router(),
            admin_static(),
        ],
        template_config=admin_templates(),
        exception_handlers={Exception: _handle_error},
        lifespan=[lifespan],
        dependencies=dependencies(),
        request_max_body_size=cfg.http.max_body_mb << 20,
        plugins=[_api_document(cfg.gateway.require_auth)],
        logging_config=None,
    )
    metrics_app = _metrics_app()
    api.state[STATE_KEY] = metrics_app.state[STATE_KEY] = gateway
    passthrough = api.state[PASSTHROUGH_STATE] = Passthrough(gateway)
    cors = Cors(cfg.gateway.cors_allow_origins) if cfg.gateway.cors_allow_origins else None
    return GatewayASGI(api, passthrough, gateway.metrics, cors), metrics_app


def _api_document(require_auth: bool) -> ApiDocument:
    """The API's document: keys in either header, and (without `require_auth`) none."""
    anonymous = "." if require_auth else "; without one a request is served anonymously."
    return ApiDocument(
        "helexa gateway",
        "One OpenAI- and Anthropic-compatible API over a fleet of nodes. Keys go in "
        "`Authorization: Bearer <key>` or `x-api-key`" + anonymous,
        schemes={BEARER: BEARER_SCHEME, API_KEY: API_KEY_SCHEME},
        security=[{BEARER: []}, {API_KEY: []}, *([] if require_auth else [{}])],
    )


def _metrics_app() -> Litestar:
    """Prometheus on its own port, with its own small document."""
    document = ApiDocument(
        "helexa gateway metrics", "The gateway's Prometheus metrics, on their own port."
    )
    return Litestar(
        route_handlers=[metrics],
        dependencies=dependencies(),
        plugins=[document],
        logging_config=None,
        exception_handlers={Exception: error_response},
    )


def _handle_error(request: Request, exc: Exception) -> Response:
    """The one place a Litestar-answered API request's exception becomes its answer: in the
    Anthropic shape on /v1/messages, the OpenAI envelope elsewhere; logged when it is a
    refusal (the pass-through routes answer their own, the same way)."""
    if isinstance(exc, HTTPException) and exc.status_code == 413:
        exc = too_large(gateway_of(request).cfg.http.max_body_mb)
    err = client_error(exc, request.method, request.url.path)
    if is_anthropic_path(request.url.path):
        return anthropic_error_response(request, err)
    return error_response(request, err)
