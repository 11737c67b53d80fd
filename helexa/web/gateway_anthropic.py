"""The Anthropic Messages API on the gateway: `POST /v1/messages` and
`POST /v1/messages/count_tokens` (docs/gateway.md § The Anthropic Messages API),
translated to the node's OpenAI chat API and back.

The exchange with the node is the OpenAI proxy's (`helexa.gateway.exchange`): auth, scope,
routing, budgets and the ledger apply unchanged, and a stream's accounting reads the node's
own events, which pass through the relay before they are translated.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp
import msgspec
from litestar import Request, post
from litestar.response import Response, Stream

from helexa.errors import HelexaError
from helexa.gateway.auth import Principal
from helexa.gateway.edge import estimate_tokens
from helexa.gateway.exchange import NodeAnswer
from helexa.gateway.proxy import warn
from helexa.gateway.service import Gateway
from helexa.logs import event
from helexa.protocol.anthropic import Translated, to_openai_chat, tokenize_body
from helexa.protocol.anthropic_out import (
    StreamTranslator,
    error_body,
    from_openai_chat,
    message_id,
)
from helexa.protocol.bodies import (
    AnthropicErrorBody,
    CountTokensBody,
    MessageAnswer,
    MessageEvent,
    MessagesBody,
    TokenCount,
)
from helexa.protocol.wire import CHARS_PER_TOKEN, SSEReader, sse_event
from helexa.web.common import as_helexa_error, parse_json_body, unless_client_leaves
from helexa.web.gateway_deps import record_of
from helexa.web.openapi import wire

log = logging.getLogger(__name__)

PING_INTERVAL_S = 10.0  # upstream silence (a long prefill) this long gets a `ping` event
CHAT_PATH = "/v1/chat/completions"
TOKENIZE_PATH = "/tokenize"
# Not for the node: reasoning must come back as `reasoning_content`, not inline text.
_NOT_FOR_NODE = ("x-include-thinking",)
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_response(request: Request, exc: Exception) -> Response:
    """Any exception as Anthropic's `{"type": "error", "error": {type, message}}`, with the
    status and headers (Retry-After) it would have had on the OpenAI routes."""
    err = as_helexa_error(request, exc)
    return Response(
        content=error_body(err.status, err.message, err.code),
        status_code=err.status,
        headers=err.headers(),
    )


@post(
    "/v1/messages",
    status_code=200,
    opt=wire(MessagesBody, MessageAnswer, events=MessageEvent, error=AnthropicErrorBody),
)
async def messages(request: Request, gateway: Gateway) -> Response:
    principal = await gateway.auth.authenticate(request.headers)
    t = to_openai_chat(parse_json_body(await request.body(), _decoder.decode))
    # a client that leaves while the node works drops the node's request
    return await unless_client_leaves(request, _exchange(request, gateway, principal, t))


async def _exchange(
    request: Request, gateway: Gateway, principal: Principal, t: Translated
) -> Response:
    exchanges = gateway.exchanges
    reply = await exchanges.open(
        principal,
        CHAT_PATH,
        t.body,
        _encoder.encode(t.body),
        request.headers,
        record_of(request),
        drop_headers=_NOT_FOR_NODE,
    )
    msg_id = message_id()
    reply.headers["request-id"] = msg_id
    if reply.status >= 400:  # logged once, by the app's error handler
        data = await exchanges.read(reply, log_error=False)
        raise upstream_error(reply.status, data, reply.resp.headers, reply.node)
    if t.stream:  # the node's own SSE headers (no-cache, no proxy buffering) came along
        translator = StreamTranslator(t, msg_id, input_tokens=estimate_tokens(t.body))
        events = anthropic_events(exchanges.relay(reply), translator)
        return Stream(events, headers=reply.headers, media_type="text/event-stream")
    answer = _json_object(await exchanges.read(reply))
    if answer is None:
        raise HelexaError(502, "api_error", "the node's answer is not a JSON object")
    return Response(content=from_openai_chat(answer, t, msg_id), headers=reply.headers)


@post(
    "/v1/messages/count_tokens",
    status_code=200,
    opt=wire(CountTokensBody, TokenCount, error=AnthropicErrorBody),
)
async def count_tokens(request: Request, gateway: Gateway) -> dict[str, int]:
    """The prompt's token count from a node serving the model (its `/tokenize`, the chat
    template and tools included); no budget is reserved and no ledger row written."""
    principal = await gateway.auth.authenticate(request.headers)
    t = to_openai_chat(parse_json_body(await request.body(), _decoder.decode), counting=True)
    answer = await gateway.exchanges.ask(
        principal,
        t.model,
        TOKENIZE_PATH,
        lambda model_id: _encoder.encode(tokenize_body(t, model_id)),
        request.headers,
        record_of(request),
        drop_headers=_NOT_FOR_NODE,
    )
    return {"input_tokens": token_count(answer, t)}


def token_count(answer: NodeAnswer, t: Translated) -> int:
    """The count in a node's `/tokenize` answer; the gateway's own estimate from a node
    that has no `/tokenize`; else the node's error, re-raised."""
    route = answer.route
    if answer.status == 200:
        count = (_json_object(answer.body) or {}).get("count")
        if isinstance(count, int):
            return count
        warn("unexpected /tokenize answer", route, TOKENIZE_PATH, body=_head(answer.body))
        raise HelexaError(502, "api_error", f"node {route.node.name} gave no token count")
    err = upstream_error(answer.status, answer.body, answer.headers, route.node.name)
    if answer.status in (404, 405) and err.code != "model_not_found":
        # a node from before /tokenize: the gateway's own estimate beats no answer
        warn("no /tokenize on the node; estimating", route, TOKENIZE_PATH, status=answer.status)
        return estimate_tokens(t.body) + _tools_estimate(t)
    raise err


async def anthropic_events(
    upstream: AsyncGenerator[bytes, None],
    translator: StreamTranslator,
    ping_interval_s: float = PING_INTERVAL_S,
) -> AsyncIterator[bytes]:
    """The node's OpenAI SSE bytes in, Anthropic's events out, with a `ping` whenever the
    node is silent for `ping_interval_s`. Leaving early (the client went) cancels the
    upstream read, which drops the node's request and settles the exchange."""
    reader = SSEReader()
    pending: asyncio.Task[bytes] | None = None
    try:
        for e in translator.start():
            yield sse_event(*e)
        while not translator.done:
            if pending is None:
                pending = asyncio.ensure_future(_next(upstream))
            done, _ = await asyncio.wait({pending}, timeout=ping_interval_s)
            if not done:
                yield sse_event("ping", {"type": "ping"})
                continue
            task, pending = pending, None
            try:
                chunk = task.result()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, TimeoutError) as exc:
                event(log, logging.WARNING, "upstream stream broke", error=repr(exc))
                break
            for sse in reader.feed(chunk):
                data = sse.data
                if data.strip() == "[DONE]":
                    continue
                try:
                    parsed = json.loads(data)
                except ValueError:
                    continue  # not a chunk we understand: the node never sends one
                for e in translator.feed(parsed):
                    yield sse_event(*e)
        for e in translator.finish():
            yield sse_event(*e)
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await upstream.aclose()


async def _next(upstream: AsyncGenerator[bytes, None]) -> bytes:
    return await upstream.__anext__()


def upstream_error(status: int, data: bytes, headers: Any, node: str) -> HelexaError:
    """The node's OpenAI error envelope as an error to re-raise, with its Retry-After and
    the node that sent it. Anything else it sent (a proxy's HTML page, a traceback) is
    logged, and the client told only the status."""
    message, code = f"node {node} answered {status}", None
    try:
        envelope = json.loads(data)
    except ValueError:
        envelope = None
    if isinstance(envelope, dict) and isinstance(envelope.get("error"), dict):
        message = str(envelope["error"].get("message") or message)
        code = envelope["error"].get("code")
    else:
        event(log, logging.WARNING, "node error without an envelope", node=node, body=_head(data))
    retry = headers.get("Retry-After")
    retry_after = float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
    err = HelexaError(status, "upstream_error", message, code=code, retry_after=retry_after)
    err.extra_headers["x-helexa-node"] = node
    return err


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = _decoder.decode(data)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def _tools_estimate(t: Translated) -> int:
    return len(json.dumps(t.body.get("tools") or [])) // CHARS_PER_TOKEN


def _head(data: bytes) -> str:
    return data[:500].decode("utf-8", "replace")
