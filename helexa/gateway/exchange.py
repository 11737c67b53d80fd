"""One request's exchange with a node, whatever API it came in on: the key's model scope,
routing (cold loads included), the edge's context check, the budget reservation, the
node's headers, then — once the answer has been relayed or read — the books settled, the
router's count and the request's log line with them. The OpenAI proxy and the Anthropic
handlers both come here, so auth, budgets and accounting are the same for every wire
format. Plain values in (the principal, the parsed body and its bytes, the client's
headers, the request's log line), no HTTP framework."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from helexa.errors import HelexaError, model_not_found, service_unavailable
from helexa.gateway.accounting import Accountant, Exchange, usage_counts
from helexa.gateway.auth import Principal
from helexa.gateway.budgets import DATABASE_RETRY_AFTER_S, Budgets, estimate_prompt_tokens
from helexa.gateway.edge import advice, check_context
from helexa.gateway.metrics import GatewayMetrics
from helexa.gateway.node_http import NodeResponse
from helexa.gateway.proxy import DROP_RESPONSE, Upstream, forward_headers, warn
from helexa.gateway.request_log import RequestRecord
from helexa.gateway.router import Route, Router
from helexa.protocol.wire import (
    ACCOUNT_HEADER,
    BUDGET_HEADER,
    DEFAULT_MAX_OUTPUT_TOKENS,
    EXCHANGE_HEADER,
    FREE,
    KEY_HEADER,
    REQUEST_ID_HEADER,
    VIA_HEADER,
    SpendBudget,
    sse_data,
    sse_event,
)

# The client's credentials stay at the gateway.
_CREDENTIALS = frozenset({"authorization", "x-api-key"})
RESPONSES_PATH = "/v1/responses"
log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class Reply:
    """A node's answer to an opened exchange, not yet read: `relay` it (a stream) or `read`
    it; either settles the exchange however it ends."""

    exchange: Exchange
    resp: NodeResponse
    path: str
    headers: dict[str, str]  # for the client: the node's, less Content-Type, + x-helexa-node
    media_type: str  # bare for text types (the web layer adds the charset)

    @property
    def status(self) -> int:
        return self.resp.status

    @property
    def is_stream(self) -> bool:
        return self.media_type.startswith("text/event-stream")

    @property
    def node(self) -> str:
        return self.headers["x-helexa-node"]

    def ends_with(self, chunk: bytes) -> bool:
        """Whether `chunk`, just relayed, was the last of a whole chat or completions stream
        (the node's answer complete, nothing after it, `data: [DONE]` last): its client's
        answer can end before the books read it."""
        resp = self.resp
        return resp.complete and not resp.chunks and chunk.endswith(b"data: [DONE]\n\n")


@dataclass(slots=True, frozen=True)
class NodeAnswer:
    """A node's whole answer to a call that is not metered (`ask`)."""

    route: Route
    status: int
    body: bytes
    headers: Mapping[str, str]


class Exchanges:
    def __init__(
        self,
        router: Router,
        upstream: Upstream,
        budgets: Budgets,
        accountant: Accountant,
        metrics: GatewayMetrics,
    ) -> None:
        self.router = router
        self.upstream = upstream
        self.budgets = budgets
        self.accountant = accountant
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    # -- before: the request's way to a node ------------------------------------------
    def check_scope(self, principal: Principal, model: str) -> None:
        """A key scoped to some models does not see the others: 404, as if they did not exist."""
        key = principal.key
        if key is not None and not (key.allows(model) or key.allows(self.router.concrete(model))):
            raise model_not_found(model)

    def node_headers(
        self, client: Mapping[str, str], principal: Principal, drop: Collection[str] = ()
    ) -> dict[str, str]:
        """The client's headers for the node: its key, any `x-helexa-*` claims and `drop`
        removed, the authenticated principal and `x-helexa-via` stamped. `x-request-id`
        (made sane by the web layer) goes along; the node's own key is added per route."""
        dropped = _CREDENTIALS if not drop else _CREDENTIALS | {d.lower() for d in drop}
        headers = forward_headers(client, dropped)
        headers[VIA_HEADER] = "gateway"
        if principal.key is not None:
            headers[ACCOUNT_HEADER] = principal.key.account_id
            headers[KEY_HEADER] = principal.key.id
        return headers

    async def open(
        self,
        principal: Principal,
        path: str,
        body: dict[str, Any],
        raw: bytes,
        client_headers: Mapping[str, str],
        record: RequestRecord | None = None,
        *,
        drop_headers: Collection[str] = (),
    ) -> Reply:
        """Send the OpenAI `body` (`raw`: its bytes as received) to the best node for its
        model. The reply holds the exchange (its route set, its reservation held) and the
        node's unread answer; it is settled however it ends, even when never read (the
        request's log line settles what its handler left)."""
        model = body["model"]
        routes = await self._routes(principal, body, client_headers, record, raw)
        if self.accountant.ledger.full:
            raise service_unavailable(
                "the gateway's books are behind: the database has not taken its last "
                f"{self.accountant.ledger.backlog} writes; retry shortly",
                DATABASE_RETRY_AFTER_S,
            )
        concrete = self.router.concrete(model)
        _note_model(record, concrete)  # the ledger's name for it, not an alias
        ex = Exchange(concrete, principal)
        entry = self.router.catalogue.get(concrete)
        ex.price = entry.cost.price() if entry else FREE
        rewrite = routes[0].model_id != model  # an alias, or a catalogue id known by source
        body["model"] = routes[0].model_id
        if principal.key is not None and principal.key.budget is not None:
            await self._reserve(ex, body, raw, routes[0], path)
            rewrite = True
        if rewrite:
            raw = _encoder.encode(body)
        headers = self.node_headers(client_headers, principal, drop_headers)
        headers[EXCHANGE_HEADER] = ex.id  # the node keeps its usage under it, for a cut
        if ex.reservation is not None:  # the node enforces it against the real prompt length
            res = ex.reservation
            headers[BUDGET_HEADER] = SpendBudget(res.tokens, res.cost, *ex.price.bound).header()
        ex.record = record
        if record is not None:
            record.hold()  # the exchange settles it (however it ends)
            record.cleanups.append(lambda: self.abandon(ex))
        tried: list[Route] = []
        try:
            route, resp = await self.upstream.open(routes, path, raw, headers, tried)
        except asyncio.CancelledError:
            if tried:  # the client left while the node worked: settled from its count
                ex.route = tried[-1]
                self.router.begin(ex.route)
                self._cut_later(ex, 499)
            else:
                self.finish(ex, 499)
            raise
        except BaseException:
            self.finish(ex, 503)  # nothing ran: no row; a reservation's release is queued
            raise
        self.router.begin(route)
        ex.route = route
        headers, media_type = _client_head(resp, route)
        reply = Reply(ex, resp, path, headers, media_type)
        ex.closer = resp.close
        return reply

    async def _routes(
        self,
        principal: Principal,
        body: dict[str, Any],
        client_headers: Mapping[str, str],
        record: RequestRecord | None,
        raw: bytes | None = None,
    ) -> list[Route]:
        """The request's candidate routes, once its scope and its prompt's size pass."""
        model = body["model"]
        _note_model(record, model)
        self.check_scope(principal, model)
        routes = await self.router.routes(model)
        context = context_limit(routes)
        try:
            check_context(body, context, raw)
        except HelexaError as e:
            hint = advice(client_headers.get("user-agent"), e, context)
            if hint:
                e.extra_headers = {"X-Helexa-Advice": hint}
            raise
        return routes

    async def _reserve(
        self, ex: Exchange, body: dict[str, Any], raw: bytes, route: Route, path: str
    ) -> None:
        """Reserve the request's upper bound on its key's budget (each of its `n` choices
        may generate its max_tokens); its max_tokens becomes what the reservation covers,
        so the node can never generate past the cap."""
        key = ex.principal.key
        assert key is not None
        limit = (route.node.models.get(route.model_id) or {}).get("limit") or {}
        ex.prompt_estimate = estimate_prompt_tokens(raw)
        # the output limit under the name(s) this wire format reads it by
        if path == RESPONSES_PATH:
            names = ["max_output_tokens"]
        else:
            names = (
                ["max_completion_tokens", "max_tokens"] if "max_completion_tokens" in body else []
            )
            names = names or ["max_tokens"]
        requested = next((body[n] for n in names if body.get(n)), None)
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            requested = limit.get("output") or DEFAULT_MAX_OUTPUT_TOKENS
        if isinstance(limit.get("context"), int):
            requested = min(requested, max(1, limit["context"] - ex.prompt_estimate))
        choices = 1 if path == RESPONSES_PATH else _choices(body.get("n"))
        ex.reservation = await self.budgets.drawing().draw(
            key, ex.model, ex.prompt_estimate, requested, ex.price.bound, choices
        )
        if ex.reservation is not None:
            for name in names:
                body[name] = ex.reservation.max_output

    # -- the answer ----------------------------------------------------------------------
    async def relay(self, reply: Reply) -> AsyncIterator[bytes]:
        """The node's stream, chunk by chunk as it arrives; each chunk goes to the client
        first and is read for the books after (its arrival time kept), so that neither
        parsing nor the settlement queued with the last event delays a byte. Nothing is
        awaited on the database (docs/gateway.md § Budgets says why a cap still holds). A
        stream the node breaks off ends with an error event; one the client leaves is
        settled from what the node says it used."""
        ex, resp = reply.exchange, reply.resp
        tally = ex.tally
        unread: bytes | None = None  # a chunk relayed, or on its way, not yet read
        arrived = 0.0
        try:
            try:
                while (chunk := await resp.part()) is not None:  # (no generator per answer)
                    unread, arrived = chunk, time.monotonic()
                    yield chunk
                    unread = None
                    if tally.feed(chunk, arrived) and not ex.settled:
                        self.finish(ex, resp.status)
            except (aiohttp.ClientError, TimeoutError) as e:
                warn("upstream stream broke", _route(ex), reply.path, error=repr(e))
            resp.release() if tally.ended else resp.close()
            if not ex.settled:  # the node went before its stream's end
                self._cut_later(ex, 502)
                yield _cut_event(reply.path, reply.node)
        finally:
            if unread is not None and not ex.settled:  # what the node sent counts, and
                tally.feed(unread, arrived)  # may be its whole answer, usage and all
                if tally.ended:
                    self.finish(ex, resp.status)
            if not ex.settled:  # the client left: the node's usage is asked off this path
                resp.close()
                self._cut_later(ex, 499)

    async def read(self, reply: Reply, *, log_error: bool = True) -> bytes:
        """The node's whole answer, its settlement queued (not awaited) as it is returned. A
        node that breaks off settles as a 502 and raises; a client that leaves (the read
        cancelled) drops the node's request and is settled from what the node used."""
        data, arrived = await self.fetch(reply)
        self.settle_whole(reply, data, arrived, log_error=log_error)
        return data

    async def fetch(self, reply: Reply) -> tuple[bytes, float]:
        """The node's whole answer and when it arrived, not yet read for the books: the
        caller sends it on, then calls `settle_whole` (however the sending ends). A node that
        breaks off settles as a 502 and raises; a client that leaves (the read cancelled)
        drops the node's request and is settled from what the node used."""
        ex, resp = reply.exchange, reply.resp
        try:
            data = await resp.read()
        except asyncio.CancelledError:
            resp.close()
            self._cut_later(ex, 499)
            raise
        except BaseException:
            resp.close()
            self._cut_later(ex, 502)
            raise
        resp.release()
        return data, time.monotonic()

    def settle_whole(
        self, reply: Reply, data: bytes, arrived: float, *, log_error: bool = True
    ) -> None:
        """The books of a whole answer `fetch` returned: its usage read, its settlement queued."""
        ex, resp = reply.exchange, reply.resp
        ex.tally.whole(data, arrived)
        self.finish(ex, resp.status)
        if resp.status >= 400 and log_error and ex.route is not None:
            body = data[:500].decode("utf-8", "replace")
            warn("upstream error", ex.route, reply.path, status=resp.status, body=body)

    async def ask(
        self,
        principal: Principal,
        model: str,
        path: str,
        body_for: Callable[[str], bytes],
        client_headers: Mapping[str, str],
        record: RequestRecord | None = None,
        *,
        drop_headers: Collection[str] = (),
    ) -> NodeAnswer:
        """A call about a request that is not metered (`/tokenize` for count_tokens): scope
        and routing as for an exchange, cold loads included; no budget, no ledger row.
        `body_for` makes the body from the model id the chosen node knows."""
        _note_model(record, model)
        self.check_scope(principal, model)
        routes = await self.router.routes(model)
        headers = self.node_headers(client_headers, principal, drop_headers)
        route, resp = await self.upstream.open(routes, path, body_for(routes[0].model_id), headers)
        try:
            data = await resp.read()
        finally:
            resp.release()
        return NodeAnswer(route, resp.status, data, resp.headers)

    # -- after ---------------------------------------------------------------------------
    def finish(self, ex: Exchange, status: int) -> None:
        """The exchange is over: the router's count, the books (queued: the writer's next
        batch makes them durable, and nobody waits for it), the metrics, the log line.
        Idempotent: only the first call counts."""
        if ex.settled:
            return
        ex.settled = True
        if ex.route is not None:
            self.router.end(ex.route)
            self._observe(ex, ex.route, status)
        (prompt, completion, *_), _ = self.accountant.close(ex, status)
        record = ex.record
        if record is not None:
            record.prompt_tokens, record.completion_tokens = prompt, completion
            record.finish_reason = ex.tally.finish_reason
            record.first_token = ex.tally.first_token
            record.node = ex.route.node.name if ex.route is not None else None
            record.release()

    def abandon(self, ex: Exchange) -> None:
        """The request is over and its exchange was never settled (its handler raised, or
        its stream was never read): drop the node's request and settle what it used."""
        if ex.settled:
            return
        if ex.closer is not None:
            ex.closer()
        self._cut_later(ex, 499)

    def _cut_later(self, ex: Exchange, status: int) -> None:
        """The answer ended before the node finished it: settle it off the request's path,
        from what the node says the exchange used. Once per exchange: the first cut seen
        (the node's 502, the client's 499) is the one booked."""
        if ex.settled or ex.cut:
            return
        ex.cut = True
        if ex.record is not None and ex.tally.finish_reason is None:
            ex.record.cut = True
        self._later(self._settle_cut(ex, status))

    async def _settle_cut(self, ex: Exchange, status: int) -> None:
        """Ask the node what the cut exchange used (it answers once its engine has reported
        on the request, however long that takes), then settle."""
        try:
            if ex.route is not None:
                ex.node_usage = await self.upstream.exchange_usage(ex.route, ex.id)
        except Exception:
            log.exception("asking node what exchange %s used failed", ex.id)
        finally:
            self.finish(ex, status)  # cancelled too: settled on what arrived

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait for settlements still running off their requests' paths (at shutdown)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    def _observe(self, ex: Exchange, route: Route, status: int) -> None:
        labels = (ex.model, route.node.name)
        m, tally = self.metrics, ex.tally
        if tally.first_token is not None and status == 200:
            m.child(m.ttft, *labels).observe(tally.first_token - ex.started)
        usage = ex.tally.usage
        if not usage or status != 200:
            return
        prompt, completion, *_ = usage_counts(usage)
        m.child(m.prompt_tokens, *labels).inc(prompt)
        m.child(m.completion_tokens, *labels).inc(completion)
        window = (tally.last_byte or 0) - (tally.first_byte or 0)
        if completion > 1 and window <= 0:
            window = (tally.last_byte or time.monotonic()) - ex.started
        if completion > 0 and window > 0:
            m.child(m.tokens_per_second, *labels).observe(completion / window)


def _route(ex: Exchange) -> Route:
    assert ex.route is not None, "a reply's exchange always has its route"
    return ex.route


def _choices(n: Any) -> int:
    """How many choices a chat or completions request asks for (the node refuses a bad n)."""
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _cut_event(path: str, node: str) -> bytes:
    """The event that ends a stream its node broke off: OpenAI's error chunk, or the
    Responses API's `error` event."""
    message = f"node {node} stopped answering mid-stream; the answer is incomplete"
    error = {"message": message, "type": "server_error", "code": "upstream_cut", "param": None}
    if path == RESPONSES_PATH:
        return sse_event("error", {"type": "error", **error})
    return sse_data({"error": error})


def context_limit(routes: list[Route]) -> int | None:
    """The smallest context any candidate replica advertises (None when none says)."""
    least = None
    for r in routes:
        n = (r.node.models.get(r.model_id) or {}).get("limit", {}).get("context")
        if isinstance(n, int) and (least is None or n < least):
            least = n
    return least


def _note_model(record: RequestRecord | None, model: str) -> None:
    if record is not None:
        record.model = model


# not passed on from a node's head: hop-by-hop ones, and its echo of the request's id (each
# door sets the request's own)
_NOT_PASSED = frozenset({*DROP_RESPONSE, REQUEST_ID_HEADER})


def _client_head(resp: NodeResponse, route: Route) -> tuple[dict[str, str], str]:
    """The node's headers for the client (less hop-by-hop ones, its request-id echo and
    Content-Type, plus x-helexa-node: which replica answered) and its media type, bare for
    text types (the web layer adds the charset): one pass over the head as it came."""
    out: dict[str, str] = {}
    media_type = None
    for name, value in resp.raw_headers:
        lower = name.lower()
        if lower == "content-type":
            media_type = value if media_type is None else media_type
        elif lower not in _NOT_PASSED:
            out[name] = value
    out["x-helexa-node"] = route.node.name
    if media_type is None:
        media_type = "application/json"
    elif media_type.startswith("text/"):
        media_type = media_type.split(";", 1)[0]
    return out, media_type
