"""Opening one exchange with a node for an authenticated request, whatever API it came in
on: model scope, routing (cold loads included), edge context check, budget reservation,
the node's headers. The OpenAI proxy and the Anthropic handlers both start here, so auth,
budgets and accounting are the same for every wire format."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from litestar import Request

from helexa.errors import HelexaError, model_not_found
from helexa.gateway.auth import Principal
from helexa.gateway.budgets import estimate_prompt_tokens
from helexa.gateway.edge import advice, check_context
from helexa.gateway.proxy import Exchange, forward_headers, response_headers
from helexa.gateway.request_log import RECORD_STATE, RequestRecord
from helexa.gateway.router import Route
from helexa.protocol.wire import (
    ACCOUNT_HEADER,
    BUDGET_HEADER,
    DEFAULT_MAX_OUTPUT_TOKENS,
    KEY_HEADER,
    VIA_HEADER,
    SpendBudget,
)

if TYPE_CHECKING:
    from helexa.web.gateway_app import GatewayState

# The client's credentials stay at the gateway.
_CREDENTIALS = ("authorization", "x-api-key")
RESPONSES_PATH = "/v1/responses"
_encoder = msgspec.json.Encoder()


def gateway_of(request: Request) -> GatewayState:
    return request.app.state.gateway


def node_headers(
    gw: GatewayState, request: Request, principal: Principal, drop: Collection[str] = ()
) -> dict[str, str]:
    """The client's headers for the node: its key, any `x-helexa-*` claims and `drop`
    removed, the authenticated principal and `x-helexa-via` stamped. `x-request-id` (made
    sane by the app) goes along; the node's own key is added per route by the upstream."""
    dropped = {*_CREDENTIALS, *drop}
    headers = {
        k: v for k, v in forward_headers(request.headers).items() if k.lower() not in dropped
    }
    headers[VIA_HEADER] = "gateway"
    if principal.key is not None:
        headers[ACCOUNT_HEADER] = principal.key.account_id
        headers[KEY_HEADER] = principal.key.id
    return headers


def record_of(request: Request) -> RequestRecord | None:
    """The request's log line in the making (set by the app's outer layer)."""
    return request.state.get(RECORD_STATE)


def note_model(request: Request, model: str) -> None:
    record = record_of(request)
    if record is not None:
        record.model = model


def check_scope(gw: GatewayState, principal: Principal, model: str) -> None:
    """A key scoped to some models does not see the others: 404, as if they did not exist."""
    key = principal.key
    if key is not None and not (key.allows(model) or key.allows(gw.router.concrete(model))):
        raise model_not_found(model)


async def open_exchange(
    request: Request,
    principal: Principal,
    path: str,
    body: dict[str, Any],
    raw: bytes,
    *,
    drop_headers: Collection[str] = (),
) -> tuple[Exchange, aiohttp.ClientResponse, dict[str, str]]:
    """Send the OpenAI `body` (`raw`: its bytes as received) to the best node for its model.

    Returns the exchange (its route set, its reservation held: the upstream's relay or read
    settles it), the node's response, and the response headers for the client (less
    Content-Type, with `x-helexa-node`)."""
    gw = gateway_of(request)
    assert gw.router is not None and gw.upstream is not None
    model = body["model"]
    note_model(request, model)
    check_scope(gw, principal, model)
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
    note_model(request, concrete)  # the ledger's name for it, not an alias
    entry = gw.router.catalogue.get(concrete)
    ex = Exchange(None, concrete, principal)
    ex.price = (entry.cost.input, entry.cost.output) if entry else (0.0, 0.0)
    rewrite = routes[0].model_id != model  # an alias, or a catalogue id known by source
    body["model"] = routes[0].model_id
    if principal.key is not None and principal.key.budget is not None:
        await _reserve(gw, ex, body, raw, routes[0], path)
        rewrite = True
    if rewrite:
        raw = _encoder.encode(body)
    headers = node_headers(gw, request, principal, drop_headers)
    if ex.reservation is not None:  # the node enforces it against the real prompt length
        res = ex.reservation
        headers[BUDGET_HEADER] = SpendBudget(res.tokens, res.cost, *ex.price).header()
    ex.record = record_of(request)
    if ex.record is not None:
        ex.record.hold()  # the exchange settles it (finish or abandon)
    try:
        route, resp = await gw.upstream.open(routes, path, raw, headers)
    except BaseException:
        gw.upstream.abandon(ex, 503)
        raise
    gw.router.begin(route)
    ex.route = route
    out = response_headers(resp.headers)
    out["x-helexa-node"] = route.node.name  # which replica answered
    for name in ("Content-Type", "content-type"):
        out.pop(name, None)
    return ex, resp, out


def _context_limit(routes: list[Route]) -> int | None:
    """The smallest context any candidate replica advertises (None when none says)."""
    limits = [(r.node.models.get(r.model_id) or {}).get("limit", {}).get("context") for r in routes]
    known = [n for n in limits if isinstance(n, int)]
    return min(known) if known else None


async def _reserve(
    gw: GatewayState, ex: Exchange, body: dict[str, Any], raw: bytes, route: Route, path: str
) -> None:
    """Reserve the request's upper bound on its key's budget; its max_tokens becomes what
    the reservation covers, so the node can never generate past the cap."""
    key = ex.principal.key
    assert key is not None and gw.budgets is not None
    limit = (route.node.models.get(route.model_id) or {}).get("limit") or {}
    ex.prompt_estimate = estimate_prompt_tokens(raw)
    # the output limit under the name(s) this wire format reads it by
    if path == RESPONSES_PATH:
        names = ["max_output_tokens"]
    else:
        names = ["max_completion_tokens", "max_tokens"] if "max_completion_tokens" in body else []
        names = names or ["max_tokens"]
    requested = next((body[n] for n in names if body.get(n)), None)
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        requested = limit.get("output") or DEFAULT_MAX_OUTPUT_TOKENS
    if isinstance(limit.get("context"), int):
        requested = min(requested, max(1, limit["context"] - ex.prompt_estimate))
    ex.reservation = await gw.budgets.reserve(key, ex.prompt_estimate, requested, ex.price)
    if ex.reservation is not None:
        for name in names:
            body[name] = ex.reservation.max_output
