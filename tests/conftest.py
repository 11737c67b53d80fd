"""Shared test fixtures: the read-only upstream model-metadata folders, tiny tokenizers, and
databases (a throwaway PostgreSQL cluster, tests/pg.py, beside SQLite files)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# transformers (the parity reference) must never reach the Hub; huggingface_hub reads this
# at import time, so it is set before any test module imports it.
os.environ["HF_HUB_OFFLINE"] = "1"

from tests.pg import PostgresCluster, PostgresUnavailable  # noqa: E402
from tests.shared_fixtures import FIXTURE_MODELS, FIXTURES_DIR, need_shared  # noqa: E402


def _triton_interprets_on_cpu() -> None:
    """Without a GPU the kernel tests run Triton through its interpreter. Triton reads
    TRITON_INTERPRET when triton itself is first imported (helexa.kernels and transformers'
    Qwen3.5 module import it), so it is set before any test module loads."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interprets_on_cpu()


_START_THREADS: list[int] = []


@pytest.fixture(autouse=True)
def _process_wide_settings_restored() -> Iterator[None]:
    """What an engine sets for its whole process (the kernel backend, the native-kernel mode,
    torch's thread count) is put back after each test: an `LLM(kernels="triton")` left the
    Triton interpreter under every later test of its xdist worker that calls a kernel
    without building an engine (the dispatcher's own tests failed by it)."""
    import sys

    import torch

    if not _START_THREADS:
        _START_THREADS.append(torch.get_num_threads())
    yield
    if (kernels := sys.modules.get("helexa.kernels")) is not None and kernels.backend() != "auto":
        kernels.set_backend("auto")
    if (native := sys.modules.get("helexa.engine.layers.native")) is not None:
        native.set_mode("auto")
    if torch.get_num_threads() != _START_THREADS[0]:
        torch.set_num_threads(_START_THREADS[0])


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The shared fixtures (tests/shared_fixtures.py): skipped without them, failed under CI."""
    return need_shared(FIXTURES_DIR)


@pytest.fixture(scope="session")
def fixture_models() -> Path:
    """The shared fixture models (real upstream configs and tokenizers), as `fixtures_dir`."""
    return need_shared(FIXTURE_MODELS)


def write_byte_tokenizer_json(
    path: Path, added: dict[int, dict], *, prepend: str | None = None
) -> None:
    """A tiny byte-level BPE tokenizer.json: 256 byte tokens (ids 0-255, no merges) plus the
    `added` tokens at their own ids; `prepend` makes the post-processor put that token in front
    (as Llama 3's tokenizer.json does with `<|begin_of_text|>`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    for token_id, spec in added.items():
        vocab[spec["content"]] = token_id
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for token_id in sorted(added):
        spec = added[token_id]
        token = AddedToken(spec["content"], special=spec.get("special", True), normalized=False)
        tok.add_special_tokens([token]) if token.special else tok.add_tokens([token])
    if prepend is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{prepend}:0 $A:0",
            pair=f"{prepend}:0 $A:0 {prepend}:1 $B:1",
            special_tokens=[(prepend, vocab[prepend])],
        )
    tok.save(str(path))


@pytest.fixture(scope="session")
def byte_tokenizer_dir(
    fixtures_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """Factory: a temp copy of a fixture model's JSON files plus a tiny byte-level tokenizer.json
    holding its special tokens at their real ids, for models whose tokenizer.json is absent.

    `specials` are tokens to add when tokenizer_config has no `added_tokens_decoder` entry for
    them (ids from 256 up); `prepend` is a token the post-processor puts in front.
    """

    def make(model: str, *, specials: Sequence[str] = (), prepend: str | None = None) -> Path:
        src = fixtures_dir / "models" / model
        dst = tmp_path_factory.mktemp(model)
        for f in src.glob("*.json"):
            shutil.copyfile(f, dst / f.name)
        config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
        added = {int(i): spec for i, spec in config.get("added_tokens_decoder", {}).items()}
        next_id = max(added, default=255) + 1
        for content in specials:
            if all(spec["content"] != content for spec in added.values()):
                added[next_id] = {"content": content, "special": True}
                next_id += 1
        write_byte_tokenizer_json(dst / "tokenizer.json", added, prepend=prepend)
        return dst

    return make


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """One throwaway PostgreSQL cluster for the session, started when a test first asks
    (about a second), stopped and removed at the end. Without PostgreSQL the tests that ask
    are skipped, except under CI (the CI variable set), where they fail: CI installs it."""
    try:
        cluster = PostgresCluster.start()
    except PostgresUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the PostgreSQL tests: {e}", pytrace=False)
        pytest.skip(f"PostgreSQL not available: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """A SQLAlchemy URL (postgresql+psycopg, over the cluster's Unix socket) of a fresh,
    empty database, dropped after the test with whatever is still connected to it."""
    name = f"test_{uuid.uuid4().hex}"
    url = postgres_cluster.create_database(name)
    try:
        yield url
    finally:
        postgres_cluster.drop_database(name)


@pytest.fixture
def sessions(tmp_path: Path):
    """Sessions on a new SQLite file at the migrations' head (gateway and bench tests)."""
    from helexa.db.session import make_engine, session_factory, upgrade

    url = f"sqlite:///{tmp_path / 'helexa.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each database helexa supports, in turn: a SQLite file (in a directory that does not
    exist yet) or a fresh PostgreSQL database. Test ids end in [sqlite] / [postgres]."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'helexa.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def db(db_url: str):
    """An engine on each supported database (as `db_url`), its schema at Alembic's head."""
    from helexa.db.session import make_engine, upgrade

    upgrade(db_url)
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


# The server tests' models and the agent node, registered once for every directory.
from tests.model_fixtures import (  # noqa: E402, F401
    agent_models,
    agent_node,
    long_id,
    model_dirs,
    scripted_id,
    tiny_id,
)
