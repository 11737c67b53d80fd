"""The TOML seeds the catalogue once; after that the database is the truth (on SQLite and on
PostgreSQL: the `db_url` fixture)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from helexa.config import Config, Cost, ModelEntry
from helexa.db.models import Alias, CatalogueModel
from helexa.db.seed import load_catalogue, seed_catalogue
from helexa.db.session import open_database

LLAMA = ModelEntry(
    id="meta-llama/Llama-3.1-8B-Instruct",
    source="huggingface",
    quant="int8",
    dtype="bfloat16",
    tensor_parallel=2,
    min_devices=3,
    min_device_vram_mb=24000,
    pinned_on=["gpu-a", "gpu-b"],
    cost=Cost(input=0.15, output=0.6),
    speculative_method="draft_model",
    speculative_model="meta-llama/Llama-3.2-1B-Instruct",
    num_speculative_tokens=3,
)
SMOL = ModelEntry(id="HuggingFaceTB/SmolLM2-135M-Instruct")


def _config(models: list[ModelEntry], aliases: dict[str, str]) -> Config:
    return Config(models=models, aliases=aliases)


@pytest.fixture
def sessions(db_url: str) -> Iterator[sessionmaker[Session]]:
    cfg = Config()
    cfg.gateway.database_url = db_url
    engine, factory = open_database(cfg)
    yield factory
    engine.dispose()


def test_first_start_seeds_the_catalogue_and_aliases_from_the_config(
    sessions: sessionmaker[Session],
) -> None:
    cfg = _config([LLAMA, SMOL], {"llama": LLAMA.id, "smol": SMOL.id})
    with sessions() as s:
        assert seed_catalogue(s, cfg) is True
    with sessions() as s:
        models, aliases = load_catalogue(s)
    assert sorted(m.id for m in models) == sorted([LLAMA.id, SMOL.id])
    assert aliases == {"llama": LLAMA.id, "smol": SMOL.id}


def test_later_starts_leave_the_database_alone_even_when_the_toml_changed(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as s:
        assert seed_catalogue(s, _config([SMOL], {"smol": SMOL.id})) is True
    changed = _config([LLAMA], {"llama": LLAMA.id, "smol": "something-else"})
    with sessions() as s:
        assert seed_catalogue(s, changed) is False
    with sessions() as s:
        models, aliases = load_catalogue(s)
        assert s.scalar(select(func.count()).select_from(CatalogueModel)) == 1
        assert s.scalar(select(func.count()).select_from(Alias)) == 1
    assert models == [SMOL]
    assert aliases == {"smol": SMOL.id}


def test_an_empty_first_seed_still_counts_so_the_console_owns_the_catalogue(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as s:
        assert seed_catalogue(s, _config([], {})) is True
    with sessions() as s:
        assert seed_catalogue(s, _config([LLAMA], {})) is False
        assert load_catalogue(s) == ([], {})


def test_load_catalogue_round_trips_every_field(sessions: sessionmaker[Session]) -> None:
    with sessions() as s:
        seed_catalogue(s, _config([LLAMA, SMOL], {}))
    with sessions() as s:
        models, _ = load_catalogue(s)
    by_id = {m.id: m for m in models}
    assert by_id[LLAMA.id] == LLAMA  # source, quant, dtype, tp, devices, vram, pins, cost, spec
    assert by_id[SMOL.id] == SMOL
    assert by_id[LLAMA.id].pinned_on == ["gpu-a", "gpu-b"]
    assert by_id[LLAMA.id].cost == Cost(input=0.15, output=0.6)
    assert by_id[LLAMA.id].required_devices == 3
