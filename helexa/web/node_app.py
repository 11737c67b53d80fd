"""The node's HTTP surface (docs/node.md § Routes): thin handlers over `helexa.node`.

Each handler parses what HTTP carries (body, headers, the caller's address), calls the
node's services with plain values and maps the result to a response. The `Node` reaches
handlers by dependency injection. Every error a client can see leaves through
`error_response` as the OpenAI envelope.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, get, post
from litestar.di import Provide
from litestar.response import Response, Stream

from helexa.node import openai_out, serving
from helexa.node.exchanges import NOTHING_RAN, Exchange, parse_wait_s
from helexa.node.security import budget_of, principal_of
from helexa.node.service import Node
from helexa.node.version import build_info
from helexa.protocol.bodies import (
    ChatCompletion,
    ChatCompletionBody,
    ChatCompletionChunk,
    Completion,
    CompletionBody,
    LoadBody,
    ModelList,
    ResponseEvent,
    ResponseObject,
    ResponsesBody,
    TokenizeBody,
    Tokens,
    UnloadBody,
)
from helexa.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from helexa.protocol.responses import parse_responses_request
from helexa.protocol.wire import EXCHANGE_HEADER
from helexa.web.common import (
    METRICS_CONTENT_TYPE,
    error_response,
    parse_json_body,
    unless_client_leaves,
)
from helexa.web.openapi import BEARER, BEARER_SCHEME, PUBLIC, ApiDocument, wire

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
THINKING_HEADER = "x-include-thinking"


# -- what HTTP carries ----------------------------------------------------------------------


async def _json_body(request: Request) -> Any:
    return parse_json_body(await request.body())


def _notes(request: Request) -> dict[str, Any]:
    """What the request's log line should say (NodeGuard writes it when the answer ends)."""
    return request.scope.setdefault("state", {})  # type: ignore[return-value]


def _trusted(request: Request) -> bool:
    """Whether the gateway's headers on `request` may be believed (set by NodeGuard)."""
    return bool(_notes(request).get("trusted"))


def include_thinking(request: Request) -> bool:
    """`x-include-thinking: true`: the caller wants reasoning inline in the content."""
    return request.headers.get(THINKING_HEADER, "").strip().lower() in ("1", "true", "yes")


def _exchange(node: Node, request: Request) -> Exchange | None:
    """The gateway's name for this request (`x-helexa-exchange`, believed like its other
    headers), begun in the node's book of exchanges; None when there is none to believe."""
    value = request.headers.get(EXCHANGE_HEADER)
    if not value or not _trusted(request):
        return None
    return node.exchanges.begin(value)


async def _as_response(work: Awaitable[dict[str, Any]]) -> Response:
    return Response(content=await work)


# -- inference ----------------------------------------------------------------------------


# A body's request, and the Responses API's fields to echo when answering in its shapes.
Parsed = tuple[ChatCompletionRequest | CompletionRequest, dict[str, Any] | None]


async def _answer(node: Node, request: Request, parse: Callable[[Any], Parsed]) -> Response:
    """Serve the request `parse` reads from the body: a stream of server-sent events, or
    the whole answer once generated. A request the gateway named (`x-helexa-exchange`)
    ends its exchange with what it spent, however it ends: its run does that, or this
    handler when no run ever started."""
    exchange = _exchange(node, request)
    streaming = False
    try:
        req, echo = parse(await _json_body(request))
        if isinstance(req, ChatCompletionRequest):
            req.include_thinking = include_thinking(request)
        trusted, notes = _trusted(request), _notes(request)
        client = request.client.host if request.client else None
        principal = principal_of(request.headers, trusted, client)
        budget = budget_of(request.headers, trusted)
        how = {
            "principal": principal,
            "budget": budget,
            "echo": echo,
            "notes": notes,
            "exchange": exchange,
        }
        if req.stream:
            run = await serving.admit(node, req, **how)
            streaming = True  # the run ends the exchange when its stream ends
            return Stream(run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
        whole = _as_response(serving.complete(node, req, **how))
        return await unless_client_leaves(request, whole)
    finally:
        if exchange is not None and not streaming:
            exchange.end(NOTHING_RAN)  # a no-op when its run has ended it


def _chat(body: Any) -> Parsed:
    return parse_chat_request(body), None


def _completion(body: Any) -> Parsed:
    return parse_completion_request(body), None


def _responses(body: Any) -> Parsed:
    parsed = parse_responses_request(body)
    return parsed.chat, parsed.echo


@post(
    "/v1/chat/completions",
    status_code=200,
    opt=wire(ChatCompletionBody, ChatCompletion, events=ChatCompletionChunk),
)
async def chat_completions(node: Node, request: Request) -> Response:
    return await _answer(node, request, _chat)


@post("/v1/completions", status_code=200, opt=wire(CompletionBody, Completion, events=Completion))
async def completions(node: Node, request: Request) -> Response:
    return await _answer(node, request, _completion)


@post(
    "/v1/responses", status_code=200, opt=wire(ResponsesBody, ResponseObject, events=ResponseEvent)
)
async def responses(node: Node, request: Request) -> Response:
    return await _answer(node, request, _responses)


@get("/v1/exchanges/{exchange_id:str}/usage")
async def exchange_usage(node: Node, request: Request, exchange_id: str) -> dict[str, Any]:
    """The final usage of the request the gateway named `exchange_id`, waiting up to
    `?wait_s=` (at most 10) for it to end: 404 unknown, 409 still running."""
    wait_s = parse_wait_s(request.query_params.get("wait_s"))
    return await node.exchanges.final_usage(exchange_id, wait_s)


@post("/tokenize", status_code=200, opt=wire(TokenizeBody, Tokens))
async def tokenize(node: Node, request: Request) -> dict[str, Any]:
    """The prompt's token ids as a generation would see them (vLLM's shape): a chat body
    (`messages`, `tools`, …, the template applied) or a completions body (`prompt`)."""
    body = await _json_body(request)
    chat = isinstance(body, dict) and "messages" in body
    req = parse_chat_request(body) if chat else parse_completion_request(body)
    if isinstance(req, ChatCompletionRequest):
        req.include_thinking = include_thinking(request)
    return await serving.tokenize(node, req, _notes(request))


@get("/v1/models", opt=wire(answer=ModelList))
async def v1_models(node: Node) -> dict[str, Any]:
    models = node.registry.models.values()
    return {"object": "list", "data": [openai_out.model_card(m) for m in models]}


# -- node management ----------------------------------------------------------------------


@get("/health", opt=PUBLIC)
async def health(node: Node) -> dict[str, Any]:
    return await node.health()


@get("/discovery")
async def discovery_route(node: Node) -> dict[str, Any]:
    return await node.discovery()


@get("/version")
async def version() -> dict[str, Any]:
    return build_info()


@get("/models")
async def models(node: Node) -> list[dict[str, Any]]:
    return node.registry.describe()


@get("/models/{rest:path}")
async def model_info(node: Node, request: Request, rest: str) -> dict[str, Any]:
    """`/models/{id}/endpoint`: where to send inference for a model; `/models/{id}`: its entry."""
    return node.model_info(rest, str(request.base_url))


@post("/models/load", status_code=200, opt=wire(LoadBody))
async def load_model(node: Node, request: Request) -> dict[str, Any]:
    return await node.load(await _json_body(request), _notes(request))


@post("/models/unload", status_code=200, opt=wire(UnloadBody))
async def unload_model(node: Node, request: Request) -> dict[str, Any]:
    return await node.unload(await _json_body(request))


@get("/metrics", media_type=METRICS_CONTENT_TYPE)
async def metrics(node: Node) -> Response:
    return Response(content=node.metrics.render(), media_type=METRICS_CONTENT_TYPE)


# -- the app ------------------------------------------------------------------------------


def create_node_app(node: Node) -> Litestar:
    """The node's Litestar app; default models load in the background once it is up."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        loading = asyncio.create_task(node.load_defaults())
        try:
            yield
        finally:
            loading.cancel()
            await node.shutdown()

    def provide_node() -> Node:
        return node

    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            responses,
            exchange_usage,
            tokenize,
            v1_models,
            health,
            discovery_route,
            version,
            models,
            model_info,
            load_model,
            unload_model,
            metrics,
        ],
        dependencies={"node": Provide(provide_node, use_cache=True, sync_to_thread=False)},
        exception_handlers={Exception: error_response},
        lifespan=[lifespan],
        request_max_body_size=node.cfg.http.max_body_mb << 20,
        plugins=[_api_document(bool(node.cfg.node.api_key))],
        logging_config=None,  # the CLI configures logging once
    )


def _api_document(keyed: bool) -> ApiDocument:
    """The node's document: with an api_key, every route not marked PUBLIC needs it."""
    return ApiDocument(
        "helexa node",
        "One host's models: OpenAI-compatible inference and the node's own management. "
        "With `[node] api_key` set, every route but `GET /health` (and this document) "
        "needs `Authorization: Bearer <api_key>`.",
        schemes={BEARER: BEARER_SCHEME},
        security=[{BEARER: []}] if keyed else None,
    )
