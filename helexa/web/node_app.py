"""The node's HTTP surface (SPEC "Node"): thin handlers over `helexa.node`.

Every error a client can see leaves through `error_response` as the OpenAI envelope.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from litestar import Litestar, Request, get, post
from litestar.response import Response, Stream

from helexa.config import Config
from helexa.engine.loader.load import BUNDLED_MODEL_ID
from helexa.errors import HelexaError, invalid_request, model_not_found, service_unavailable
from helexa.node import openai_out
from helexa.node.admission import Permit
from helexa.node.discovery import device_stats, discovery
from helexa.node.generation import Generation, prepare_prompt, render_prompt
from helexa.node.metrics import NodeMetrics
from helexa.node.registry import LoadOptions, ModelRegistry
from helexa.node.responses_out import ResponsesView
from helexa.node.security import loadable_ref, unauthenticated_warning
from helexa.node.version import build_info
from helexa.protocol.limits import check_bounds
from helexa.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from helexa.protocol.responses import parse_responses_request
from helexa.protocol.wire import (
    ACCOUNT_HEADER,
    BUDGET_HEADER,
    KEY_HEADER,
    SSE_DONE,
    VIA_HEADER,
    SpendBudget,
    sse_data,
    sse_event,
)
from helexa.web.common import METRICS_CONTENT_TYPE, error_response, parse_json_body

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
THINKING_HEADER = "x-include-thinking"


@dataclass(slots=True)
class NodeState:
    cfg: Config
    registry: ModelRegistry
    metrics: NodeMetrics
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    load_defaults: bool = True
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)


def _node(request: Request) -> NodeState:
    return request.app.state.node


# -- helpers ------------------------------------------------------------------------------


async def _json_body(request: Request) -> Any:
    return parse_json_body(await request.body())


def _trusted(request: Request) -> bool:
    """Whether the gateway's headers on `request` may be believed (set by NodeGuard)."""
    return bool(request.scope.get("state", {}).get("trusted"))


def principal_of(request: Request) -> str | None:
    """Who is calling, for the per-principal cap: `account/key` as the gateway stamps it;
    None for the gateway's anonymous traffic (it caps that itself); anyone else is an
    anonymous direct caller, counted by client address."""
    headers = request.headers
    if _trusted(request):
        account, key = headers.get(ACCOUNT_HEADER), headers.get(KEY_HEADER)
        if account or key:
            return f"{account or '-'}/{key or '-'}"
        if headers.get(VIA_HEADER):
            return None
    client = request.client
    return f"client:{client.host if client else '?'}"


def budget_of(request: Request) -> SpendBudget | None:
    """The gateway's reservation for this request (`x-helexa-budget`), if it sent one."""
    value = request.headers.get(BUDGET_HEADER)
    if not value or not _trusted(request):
        return None
    try:
        return SpendBudget.parse(value)
    except ValueError as e:
        raise invalid_request(f"{BUDGET_HEADER}: {e}", BUDGET_HEADER) from None


def _note(request: Request, **fields: Any) -> None:
    """What the request's log line should say (NodeGuard writes it when the answer ends)."""
    request.scope.setdefault("state", {}).update(fields)  # type: ignore[typeddict-item]


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- inference ----------------------------------------------------------------------------


async def _serve(
    request: Request,
    req: ChatCompletionRequest | CompletionRequest,
    echo: dict[str, Any] | None = None,
) -> Response:
    """Admit, render and run one request; answer in the chat/completions shapes, or in the
    Responses API's when `echo` (the Responses fields the answer repeats) is given."""
    node = _node(request)
    _note(request, model=req.model)
    if node.draining:
        raise service_unavailable("the node is shutting down; retry on another node", 5)
    check_bounds(req)
    served = node.registry.get(req.model)
    principal = principal_of(request)
    served.admission.check(principal)  # a full queue answers before any tokenizing
    prompt = await asyncio.to_thread(prepare_prompt, served, req)
    _note(request, prompt_tokens=len(prompt.ids))
    budget = budget_of(request)
    if budget is not None:
        budget.apply(req, len(prompt.ids))  # the output the gateway's reservation covers
    permit = await served.admission.acquire(principal)
    try:
        gen = Generation(node.registry, served, req, prompt, node.metrics)
        view = ResponsesView(gen, echo) if echo is not None else None
    except BaseException:
        permit.release()
        raise
    state = request.scope["state"]
    if req.stream:
        body = (
            _stream(gen, permit, state) if view is None else _stream_responses(view, permit, state)
        )
        weakref.finalize(body, permit.release)  # a stream never started still frees its slot
        return Stream(body, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        work = asyncio.create_task(_collect(gen, view))
        gone = asyncio.create_task(_until_disconnected(request))
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left: stop generating, free the KV
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(content=b"", status_code=499)
        gone.cancel()
        return Response(content=work.result())
    finally:
        _note_outcome(state, gen)
        permit.release()


async def _collect(gen: Generation, view: ResponsesView | None) -> dict[str, Any]:
    async for _ in gen.deltas():
        pass
    return openai_out.full_response(gen) if view is None else view.whole()


def _note_outcome(state: dict[str, Any], gen: Generation) -> None:
    reasons = {c.finish_reason or "abort" for c in gen.choices}
    state["completion_tokens"] = sum(c.num_tokens for c in gen.choices)
    state["finish_reason"] = ",".join(sorted(reasons))
    if gen.ttft_s is not None:
        state["ttft_ms"] = gen.ttft_s * 1000


async def _stream(gen: Generation, permit: Permit, state: dict[str, Any]) -> AsyncIterator[bytes]:
    try:
        for chunk in openai_out.opening_chunks(gen):
            yield sse_data(chunk)
        async for i, out in gen.deltas():
            for chunk in openai_out.delta_chunks(gen, i, out):
                yield sse_data(chunk)
        if gen.req.include_usage:
            yield sse_data(openai_out.usage_chunk(gen))
    except HelexaError as e:  # headers are gone: the error travels as an SSE event
        log.warning("stream %s failed: %s", gen.id, e.message)
        state["error"] = e.status
        yield sse_data(e.to_envelope())
    finally:
        _note_outcome(state, gen)
        permit.release()
    yield SSE_DONE


async def _stream_responses(
    view: ResponsesView, permit: Permit, state: dict[str, Any]
) -> AsyncIterator[bytes]:
    """Named events (`event: response.output_text.delta`), no `[DONE]`: the API's own."""
    gen = view.gen
    try:
        for e in view.opening():
            yield sse_event(e["type"], e)
        async for _, _out in gen.deltas():
            for e in view.delta(gen.choices[0].last):
                yield sse_event(e["type"], e)
        for e in view.closing():
            yield sse_event(e["type"], e)
    except HelexaError as e:
        log.warning("stream %s failed: %s", view.id, e.message)
        state["error"] = e.status
        failed = view.failed(e)
        yield sse_event(failed["type"], failed)
    finally:
        _note_outcome(state, gen)
        permit.release()


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    req = parse_chat_request(await _json_body(request))
    req.include_thinking = include_thinking(request)
    return await _serve(request, req)


def include_thinking(request: Request) -> bool:
    """`x-include-thinking: true`: the caller wants reasoning inline in the content."""
    return request.headers.get(THINKING_HEADER, "").strip().lower() in ("1", "true", "yes")


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    return await _serve(request, parse_completion_request(await _json_body(request)))


@post("/v1/responses", status_code=200)
async def responses(request: Request) -> Response:
    parsed = parse_responses_request(await _json_body(request))
    parsed.chat.include_thinking = include_thinking(request)
    return await _serve(request, parsed.chat, parsed.echo)


@post("/tokenize", status_code=200)
async def tokenize(request: Request) -> dict[str, Any]:
    """The prompt's token ids as a generation would see them (vLLM's shape): a chat body
    (`messages`, `tools`, …, the template applied) or a completions body (`prompt`)."""
    body = await _json_body(request)
    chat = isinstance(body, dict) and "messages" in body
    req = parse_chat_request(body) if chat else parse_completion_request(body)
    if isinstance(req, ChatCompletionRequest):
        req.include_thinking = include_thinking(request)
    _note(request, model=req.model)
    check_bounds(req)
    served = _node(request).registry.get(req.model)
    prompt = await asyncio.to_thread(render_prompt, served, req)
    return {"count": len(prompt.ids), "max_model_len": served.max_model_len, "tokens": prompt.ids}


@get("/v1/models")
async def v1_models(request: Request) -> dict[str, Any]:
    models = _node(request).registry.models.values()
    return {"object": "list", "data": [openai_out.model_card(m) for m in models]}


# -- node management ----------------------------------------------------------------------


@get("/health")
async def health(request: Request) -> dict[str, Any]:
    node = _node(request)
    registry = node.registry
    return {
        "status": "draining" if node.draining else "ok",
        "uptime_s": round(time.time() - node.started_at, 1),
        "devices": await asyncio.to_thread(device_stats),
        "activation": registry.activation.to_dict(),
        "models": [
            {
                "id": m.id,
                "status": m.status,
                "in_flight": m.admission.num_running,
                "queue_depth": m.admission.queue_depth,
            }
            for m in registry.models.values()
        ],
    }


@get("/discovery")
async def discovery_route(request: Request) -> dict[str, Any]:
    node = _node(request)
    inputs = [m.limit["input"] for m in node.registry.models.values()]
    found = await asyncio.to_thread(discovery, min(inputs) if inputs else None)
    found["auth"] = "api_key" if node.cfg.node.api_key else "none"
    warning = unauthenticated_warning(node.cfg.node.host, node.cfg.node)
    found["warnings"] = [warning] if warning else []
    return found


@get("/version")
async def version() -> dict[str, Any]:
    return build_info()


@get("/models")
async def models(request: Request) -> list[dict[str, Any]]:
    return _node(request).registry.describe()


@get("/models/{rest:path}")
async def model_info(request: Request, rest: str) -> dict[str, Any]:
    """`/models/{id}/endpoint`: where to send inference for a model; `/models/{id}`: its entry."""
    node = _node(request)
    model_id = rest.strip("/")
    wants_endpoint = model_id.endswith("/endpoint")
    if wants_endpoint:
        model_id = model_id.removesuffix("/endpoint")
    # the router folds `//`, so `/models//srv/m/endpoint` names `/srv/m` as well as `srv/m`
    models = node.registry.models
    served = models.get(model_id) or models.get("/" + model_id)
    if served is None:
        raise model_not_found(model_id)
    model_id = served.id
    if not wants_endpoint:
        return served.describe()
    base = node.cfg.node.advertise_endpoint or str(request.base_url)
    return {"model_id": model_id, "endpoint": base.rstrip("/")}


@post("/models/load", status_code=200)
async def load_model(request: Request) -> dict[str, Any]:
    node = _node(request)
    if node.draining:
        raise service_unavailable("the node is shutting down", 5)
    options = _load_options(await _json_body(request))
    _note(request, model=options.model_id)
    ref = loadable_ref(options.model_id, node.cfg.node.model_dirs or [], BUNDLED_MODEL_ID)
    served = await node.registry.load(dataclasses.replace(options, ref=ref))
    return {"status": "loaded", "model": served.describe()}


@post("/models/unload", status_code=200)
async def unload_model(request: Request) -> dict[str, Any]:
    body = await _json_body(request)
    model_id = body.get("model_id") if isinstance(body, dict) else None
    if not isinstance(model_id, str) or not model_id:
        raise invalid_request("model_id: expected a non-empty string", "model_id")
    if not await _node(request).registry.unload(model_id):
        raise model_not_found(model_id)
    return {"status": "unloaded", "model_id": model_id}


def _load_options(body: Any) -> LoadOptions:
    if not isinstance(body, dict):
        raise invalid_request("expected a JSON object with model_id", "body")

    def opt(name: str, kind: type, what: str) -> Any:
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise invalid_request(f"{name}: expected {what}, got {json.dumps(value)}", name)
        return value

    model_id = opt("model_id", str, "a string")
    if not model_id:
        raise invalid_request("model_id: required", "model_id")
    devices = opt("devices", list, "an array of device indices")
    if devices is not None and not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices
    ):
        raise invalid_request("devices: expected non-negative integers", "devices")
    tp = opt("tensor_parallel", int, "an integer")
    if tp is not None and tp < 1:
        raise invalid_request("tensor_parallel: must be >= 1", "tensor_parallel")
    return LoadOptions(
        model_id=model_id,
        quant=opt("quant", str, "a string"),
        dtype=opt("dtype", str, "a string"),
        devices=tuple(devices) if devices else None,
        tensor_parallel=tp or 1,
        revision=opt("revision", str, "a string"),
    )


@get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(content=_node(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)


# -- errors and the app -------------------------------------------------------------------


def create_node_app(cfg: Config, *, load_defaults: bool = True) -> Litestar:
    """The node's Litestar app; default models load in the background once it is up."""
    registry = ModelRegistry(cfg)
    node = NodeState(cfg, registry, NodeMetrics(registry), load_defaults=load_defaults)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if node.load_defaults:
            task = asyncio.create_task(registry.load_defaults())
            node._tasks.add(task)
            task.add_done_callback(node._tasks.discard)
        try:
            yield
        finally:
            node.draining = True
            for task in list(node._tasks):
                task.cancel()
            await registry.shutdown()
            log.info("node stopped: all models unloaded")

    app = Litestar(
        route_handlers=[
            chat_completions,
            completions,
            responses,
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
        exception_handlers={Exception: error_response},
        lifespan=[lifespan],
        request_max_body_size=cfg.http.max_body_mb << 20,
        openapi_config=None,
        logging_config=None,  # the CLI configures logging once
    )
    app.state.node = node
    return app
