"""Edits to the catalogue and aliases in the database (what the admin console's Models page
does). Each function validates, writes one transaction, and raises ValueError with a
message fit to show a person; the caller reloads its router from `catalogue_rows` at once,
and other gateways on the database do at their next poll (`poller.DatabaseSync`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from helexa.config import DTYPES, KV_CACHE_DTYPES, ModelEntry
from helexa.db.models import Alias, CatalogueModel, utcnow
from helexa.db.seed import load_catalogue, row_of
from helexa.protocol.wire import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

MAX_ID_CHARS = 500


def _int(params: Mapping[str, str], name: str, *, minimum: int = 1) -> int | None:
    text = (params.get(name) or "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}: expected a whole number, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{name}: must be at least {minimum}, got {value}")
    return value


def _price(params: Mapping[str, str], name: str) -> float:
    return _price_or_none(params, name) or 0.0


def _price_or_none(params: Mapping[str, str], name: str) -> float | None:
    """A price a person typed; None when blank."""
    text = (params.get(name) or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}: expected a price in USD per 1M tokens, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: must be a price of 0 or more, got {text!r}")
    return value


def _model_id(params: Mapping[str, str], name: str) -> str | None:
    text = (params.get(name) or "").strip()
    if len(text) > MAX_ID_CHARS:
        raise ValueError(f"{name}: at most {MAX_ID_CHARS} characters, got {len(text)}")
    return text or None


def _revision(params: Mapping[str, str]) -> str | None:
    """A hub branch, tag or commit: no spaces, at most 200 characters (the column's)."""
    text = (params.get("revision") or "").strip()
    if len(text) > 200 or any(c.isspace() for c in text):
        raise ValueError(
            f"revision: a branch, tag or commit (no spaces, at most 200), got {text!r}"
        )
    return text or None


def entry_from_form(
    params: Mapping[str, str], pinned_on: Sequence[str], nodes: Sequence[str]
) -> ModelEntry:
    """A catalogue entry from the Models form; ValueError naming the first bad field."""
    model_id = (params.get("id") or "").strip()
    if not model_id:
        raise ValueError("id: a model id is required (e.g. Qwen/Qwen3-8B)")
    if len(model_id) > MAX_ID_CHARS:
        raise ValueError(f"id: at most {MAX_ID_CHARS} characters, got {len(model_id)}")
    dtype = (params.get("dtype") or "").strip() or None
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    unknown = sorted(set(pinned_on) - set(nodes))
    if unknown:
        raise ValueError(f"pinned_on: {', '.join(unknown)} is not a configured node")
    tp = _int(params, "tensor_parallel") or 1
    min_devices = _int(params, "min_devices")
    if min_devices is not None and min_devices < tp:
        raise ValueError(f"min_devices: {min_devices} is below tensor_parallel {tp}")
    method = (params.get("speculative_method") or "").strip() or None
    if method is not None and method not in SPECULATIVE_METHODS:
        choices = ", ".join(SPECULATIVE_METHODS)
        raise ValueError(f"speculative_method: expected one of {choices}, got {method!r}")
    kv_dtype = (params.get("kv_cache_dtype") or "").strip() or None
    if kv_dtype is not None and kv_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {kv_dtype!r}"
        )
    num_spec = _int(params, "num_speculative_tokens")
    if num_spec is not None and num_spec > MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"num_speculative_tokens: at most {MAX_SPECULATIVE_TOKENS}, got {num_spec}"
        )
    entry = ModelEntry(
        id=model_id,
        source=(params.get("source") or "").strip() or None,
        quant=(params.get("quant") or "").strip() or None,
        dtype=dtype,  # type: ignore[arg-type]  # checked against DTYPES above
        tensor_parallel=tp,
        min_devices=min_devices,
        min_device_vram_mb=_int(params, "min_device_vram_mb"),
        pinned_on=sorted(set(pinned_on)),
        speculative_method=method,  # type: ignore[arg-type]  # checked above
        speculative_model=_model_id(params, "speculative_model"),
        num_speculative_tokens=num_spec,
        revision=_revision(params),
        kv_cache_dtype=kv_dtype,  # type: ignore[arg-type]  # checked above
        max_model_len=_int(params, "max_model_len"),
        kv_cache_memory_mb=_int(params, "kv_cache_memory_mb"),
    )
    if (problem := entry.speculative_problem()) is not None:
        raise ValueError(problem)
    entry.cost.input = _price(params, "cost_input")
    entry.cost.output = _price(params, "cost_output")
    entry.cost.cache_read = _price_or_none(params, "cost_cache_read")  # blank: input's
    entry.cost.cache_write = _price_or_none(params, "cost_cache_write")
    return entry


def add_model(sessions: sessionmaker[Session], entry: ModelEntry) -> None:
    with sessions.begin() as s:
        if s.get(CatalogueModel, entry.id) is not None:
            raise ValueError(f"id: {entry.id!r} is already in the catalogue; edit it instead")
        if s.get(Alias, entry.id) is not None:
            raise ValueError(f"id: {entry.id!r} is already an alias")
        s.add(row_of(entry))


def update_model(sessions: sessionmaker[Session], entry: ModelEntry) -> None:
    with sessions.begin() as s:
        row = s.get(CatalogueModel, entry.id)
        if row is None:
            raise ValueError(f"id: {entry.id!r} is not in the catalogue")
        fresh = row_of(entry)
        for column in CatalogueModel.__table__.columns:
            if column.key not in ("id", "created_at", "updated_at"):
                setattr(row, column.key, getattr(fresh, column.key))
        row.updated_at = utcnow()


def set_pinned(sessions: sessionmaker[Session], model_id: str, node: str, pinned: bool) -> None:
    """Pin `model_id` on `node` (never evicted there) or unpin it."""
    with sessions.begin() as s:
        row = s.get(CatalogueModel, model_id)
        if row is None:
            raise ValueError(f"{model_id!r} is not in the catalogue")
        nodes = set(row.pinned_on or [])
        nodes = nodes | {node} if pinned else nodes - {node}
        row.pinned_on = sorted(nodes)
        row.updated_at = utcnow()


def delete_model(sessions: sessionmaker[Session], model_id: str) -> None:
    """Remove a catalogue entry; refused while an alias still points at it."""
    with sessions.begin() as s:
        row = s.get(CatalogueModel, model_id)
        if row is None:
            raise ValueError(f"{model_id!r} is not in the catalogue")
        aliases = s.scalars(select(Alias.alias).where(Alias.target == model_id)).all()
        if aliases:
            raise ValueError(
                f"{model_id!r} is the target of alias {', '.join(map(repr, aliases))}; "
                "delete or repoint the alias first"
            )
        s.delete(row)


def set_alias(sessions: sessionmaker[Session], alias: str, target: str) -> None:
    """Create or repoint an alias; its target must be a catalogue id."""
    alias, target = alias.strip(), target.strip()
    if not alias:
        raise ValueError("alias: a name is required (e.g. helexa/small)")
    if len(alias) > MAX_ID_CHARS:
        raise ValueError(f"alias: at most {MAX_ID_CHARS} characters, got {len(alias)}")
    with sessions.begin() as s:
        if s.get(CatalogueModel, target) is None:
            raise ValueError(f"target: {target!r} is not in the catalogue")
        if s.get(CatalogueModel, alias) is not None:
            raise ValueError(f"alias: {alias!r} is a catalogue id; an alias needs its own name")
        row = s.get(Alias, alias)
        if row is None:
            s.add(Alias(alias=alias, target=target))
        else:
            row.target = target


def delete_alias(sessions: sessionmaker[Session], alias: str) -> None:
    with sessions.begin() as s:
        row = s.get(Alias, alias)
        if row is None:
            raise ValueError(f"alias {alias!r} does not exist")
        s.delete(row)


def catalogue_rows(sessions: sessionmaker[Session]) -> tuple[list[ModelEntry], dict[str, str]]:
    """The catalogue and aliases as stored (what the router is reloaded from)."""
    with sessions() as s:
        return load_catalogue(s)
