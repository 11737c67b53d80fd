"""The catalogue's first start: `[[models]]` and `[aliases]` from the TOML seed the database
once; from then on the database is the truth (the admin console edits it)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from helexa.config import Config, Cost, ModelEntry
from helexa.db.models import Alias, CatalogueModel, Setting, utcnow

SEEDED = "catalogue_seeded"  # settings key; its value is when it happened


def seed_catalogue(session: Session, cfg: Config) -> bool:
    """Copy cfg.models and cfg.aliases into an unseeded database and commit; True if it did."""
    if session.get(Setting, SEEDED) is not None:
        return False
    session.add_all(row_of(m) for m in cfg.models)
    session.add_all(Alias(alias=a, target=t) for a, t in cfg.aliases.items())
    session.add(Setting(key=SEEDED, value=utcnow().isoformat()))
    try:
        session.commit()
    except IntegrityError:  # another gateway on the same database seeded it first
        session.rollback()
        return False
    return True


def load_catalogue(session: Session) -> tuple[list[ModelEntry], dict[str, str]]:
    """The database's catalogue as config entries (what the router consumes) and its aliases."""
    models = [
        entry_of(row) for row in session.scalars(select(CatalogueModel).order_by(CatalogueModel.id))
    ]
    aliases = {a.alias: a.target for a in session.scalars(select(Alias).order_by(Alias.alias))}
    return models, aliases


def row_of(m: ModelEntry) -> CatalogueModel:
    return CatalogueModel(
        id=m.id,
        source=m.source,
        quant=m.quant,
        dtype=m.dtype,
        tensor_parallel=m.tensor_parallel,
        min_devices=m.min_devices,
        min_device_vram_mb=m.min_device_vram_mb,
        pinned_on=list(m.pinned_on),
        cost_input=m.cost.input,
        cost_output=m.cost.output,
        cost_cache_read=m.cost.cache_read,
        cost_cache_write=m.cost.cache_write,
        speculative_method=m.speculative_method,
        speculative_model=m.speculative_model,
        num_speculative_tokens=m.num_speculative_tokens,
        revision=m.revision,
        kv_cache_dtype=m.kv_cache_dtype,
        max_model_len=m.max_model_len,
        kv_cache_memory_mb=m.kv_cache_memory_mb,
    )


def entry_of(row: CatalogueModel) -> ModelEntry:
    return ModelEntry(
        id=row.id,
        source=row.source,
        quant=row.quant,
        dtype=row.dtype,  # type: ignore[arg-type]  # a DType when written through the config
        tensor_parallel=row.tensor_parallel,
        min_devices=row.min_devices,
        min_device_vram_mb=row.min_device_vram_mb,
        pinned_on=list(row.pinned_on or []),
        cost=Cost(
            input=row.cost_input,
            output=row.cost_output,
            cache_read=row.cost_cache_read,
            cache_write=row.cost_cache_write,
        ),
        speculative_method=row.speculative_method,  # type: ignore[arg-type]  # as dtype
        speculative_model=row.speculative_model,
        num_speculative_tokens=row.num_speculative_tokens,
        revision=row.revision,
        kv_cache_dtype=row.kv_cache_dtype,  # type: ignore[arg-type]  # as dtype
        max_model_len=row.max_model_len,
        kv_cache_memory_mb=row.kv_cache_memory_mb,
    )
