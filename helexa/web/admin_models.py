"""The Models page: the catalogue (add, edit, delete, pin), aliases, and loading or
unloading a model on a chosen node with its status polled while it loads."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from litestar import Request, Response, get, post
from litestar.datastructures import FormMultiDict

from helexa.config import KV_CACHE_DTYPES, ModelEntry
from helexa.gateway import catalogue_edit as edit
from helexa.gateway.service import Gateway
from helexa.web.admin_common import form_of, render, text, texts


def _placement(gateway: Gateway) -> dict[str, Any]:
    """What each node holds now, and the loads and unloads asked for here."""
    nodes = sorted(gateway.fleet.nodes.values(), key=lambda n: n.name)
    jobs = gateway.jobs.recent()
    placement = [
        {"node": n, "models": [n.models[m] | {"id": m} for m in sorted(n.models)]} for n in nodes
    ]
    busy = any(j.state == "running" for j in jobs) or any(
        m.get("status") in ("loading", "recovering") for p in placement for m in p["models"]
    )
    return {"placement": placement, "jobs": jobs, "busy": busy}


def _context(gateway: Gateway, **extra: Any) -> dict[str, Any]:
    router = gateway.router
    nodes = sorted(gateway.fleet.nodes.values(), key=lambda n: n.name)
    entries = []
    for model_id in sorted(router.catalogue):
        entry = router.catalogue[model_id]
        node_id = router.node_model_id(model_id)
        where = [(n.name, n.status_of(node_id)) for n in nodes if n.status_of(node_id)]
        aliases = sorted(a for a, t in router.aliases.items() if t == model_id)
        entries.append(
            {"entry": entry, "where": where, "aliases": aliases, "speculative": _speculative(entry)}
        )
    context = {
        "entries": entries,
        "aliases": sorted(router.aliases.items()),
        "nodes": [n.name for n in nodes],
        "up_nodes": [n.name for n in nodes if n.up],
        "dtypes": edit.DTYPES,
        "speculative_methods": edit.SPECULATIVE_METHODS,
        "kv_cache_dtypes": KV_CACHE_DTYPES,
        "notice": None,
        "error": None,
        "form": {},
        "failed_form": None,  # which form the error belongs to
    }
    return context | _placement(gateway) | extra


def _speculative(entry: ModelEntry) -> str | None:
    """The entry's speculative decoding as its Options cell says it (None: the node's)."""
    method, num = entry.speculative_method, entry.num_speculative_tokens
    words = []
    if method is not None or num is not None:
        words = [f"speculative {method or 'as the node'}", entry.speculative_model]
        words.append(f"×{num}" if num else None)
    if entry.revision:
        words.append(f"revision {entry.revision}")
    if entry.kv_cache_dtype:
        words.append(f"KV {entry.kv_cache_dtype}")
    if entry.max_model_len:
        words.append(f"context {entry.max_model_len}")
    if entry.kv_cache_memory_mb:
        words.append(f"KV pool {entry.kv_cache_memory_mb} MiB")
    return " ".join(w for w in words if w) or None


def _page(request: Request, gateway: Gateway, status: int = 200, **extra: Any) -> Response:
    return render(request, "models", status=status, **_context(gateway, **extra))


async def _change(
    request: Request,
    gateway: Gateway,
    which: str,
    work: Callable[[FormMultiDict], object],
    done: str,
) -> Response:
    """Run one edit; the page again with a notice, or with the error beside its form. The
    router then routes by what the database now says."""
    form = await form_of(request)
    try:
        await asyncio.to_thread(work, form)
    except ValueError as e:
        return _page(request, gateway, 422, error=str(e), form=dict(form), failed_form=which)
    rows = await asyncio.to_thread(edit.catalogue_rows, gateway.sessions)
    gateway.router.replace_catalogue(*rows)
    return _page(request, gateway, notice=done.format_map(defaultdict(str, dict(form))))


@get("/models")
async def models_page(request: Request, gateway: Gateway) -> Response:
    return _page(request, gateway)


@get("/models/placement")
async def placement(request: Request, gateway: Gateway) -> Response:
    """The nodes' models and the jobs alone: polled while something loads."""
    return render(request, "models", partial="placement", **_context(gateway))


def _entry(gateway: Gateway, form: FormMultiDict) -> ModelEntry:
    return edit.entry_from_form(form, texts(form, "pinned_on"), list(gateway.fleet.nodes))


@post("/models")
async def add_model(request: Request, gateway: Gateway) -> Response:
    return await _change(
        request,
        gateway,
        "add",
        lambda form: edit.add_model(gateway.sessions, _entry(gateway, form)),
        "Added {id} to the catalogue.",
    )


@post("/models/edit")
async def update_model(request: Request, gateway: Gateway) -> Response:
    return await _change(
        request,
        gateway,
        "edit",
        lambda form: edit.update_model(gateway.sessions, _entry(gateway, form)),
        "Saved {id}.",
    )


@post("/models/pin")
async def pin_model(request: Request, gateway: Gateway) -> Response:
    def work(form: FormMultiDict) -> None:
        node = text(form, "node")
        if node not in gateway.fleet.nodes:
            raise ValueError(f"node: {node!r} is not a configured node")
        edit.set_pinned(gateway.sessions, text(form, "id"), node, text(form, "pinned") == "true")

    return await _change(request, gateway, "pin", work, "Pinning of {id} on {node} saved.")


@post("/models/delete")
async def delete_model(request: Request, gateway: Gateway) -> Response:
    return await _change(
        request,
        gateway,
        "delete",
        lambda form: edit.delete_model(gateway.sessions, text(form, "id")),
        "Deleted {id} from the catalogue.",
    )


@post("/aliases")
async def set_alias(request: Request, gateway: Gateway) -> Response:
    return await _change(
        request,
        gateway,
        "alias",
        lambda form: edit.set_alias(gateway.sessions, text(form, "alias"), text(form, "target")),
        "Alias {alias} now points at {target}.",
    )


@post("/aliases/delete")
async def delete_alias(request: Request, gateway: Gateway) -> Response:
    return await _change(
        request,
        gateway,
        "alias",
        lambda form: edit.delete_alias(gateway.sessions, text(form, "alias")),
        "Deleted alias {alias}.",
    )


@post("/models/load")
async def load_model(request: Request, gateway: Gateway) -> Response:
    form = await form_of(request)
    node, model = text(form, "node"), text(form, "model")
    try:
        if not model:
            raise ValueError("model: choose a model to load")
        job = gateway.jobs.load(node, model)
    except ValueError as e:
        return _page(request, gateway, 422, error=str(e), form=dict(form), failed_form="load")
    return _page(request, gateway, notice=f"Loading {job.model_id} on {job.node}…")


@post("/models/unload")
async def unload_model(request: Request, gateway: Gateway) -> Response:
    form = await form_of(request)
    try:
        job = gateway.jobs.unload(text(form, "node"), text(form, "model_id"))
    except ValueError as e:
        return _page(request, gateway, 422, error=str(e), failed_form="load")
    return _page(request, gateway, notice=f"Unloading {job.model_id} from {job.node}…")


MODEL_HANDLERS = [
    models_page,
    placement,
    add_model,
    update_model,
    pin_model,
    delete_model,
    set_alias,
    delete_alias,
    load_model,
    unload_model,
]
