"""Several gateways on one database, SQLite and PostgreSQL. In-process: what `DatabaseSync`
re-reads each poll interval, and how it keeps going when the database cannot be read. Real
gateway processes on one real database: admin logins outlive a restart and work on every gateway; catalogue,
alias and key edits made through one gateway (its console or `helexa keys`) reach the
others by their own database poll (nothing is asked of them), and still apply at once on
the gateway that made them."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from helexa.config import Config, ModelEntry
from helexa.db.session import make_engine, session_factory, upgrade
from helexa.errors import HelexaError
from helexa.gateway import catalogue_edit as edit
from helexa.gateway import poller
from helexa.gateway.auth import Authenticator
from helexa.gateway.fleet import Fleet
from helexa.gateway.keys import KeyStore
from helexa.gateway.poller import DatabaseSync
from helexa.gateway.router import Router
from helexa.passwords import hash_password
from tests.gateway.gateway_proc import GatewayProcess, start_gateway
from tests.model_fixtures import SCRIPT
from tests.shared_fixtures import need_shared
from tests.web.node_proc import NodeProcess, free_port, scripted_model, start_node

PASSWORD = "correct horse battery"
POLL_S = 0.5
COOKIE = "helexa_admin"
CSRF_FIELD = re.compile(r'name="csrf" value="([^"]+)"')


def gateway(
    tmp: Path, database_url: str, nodes: dict[str, NodeProcess | str], **kw
) -> GatewayProcess:
    return start_gateway(
        tmp,
        nodes,
        poll_interval_s=POLL_S,
        gateway={"require_auth": True, "database_url": database_url},
        admin={"password_hash": hash_password(PASSWORD), "session_ttl_s": 3600},
        **kw,
    )


def config_of(gw: GatewayProcess) -> Path:
    port = gw.base_url.rsplit(":", 1)[1]
    return gw.log_path.with_name(f"gateway-{port}.toml")


def log_in(gw: GatewayProcess) -> str:
    """Log in on `gw`'s console; the session cookie's value."""
    with httpx.Client(base_url=gw.base_url, timeout=30) as http:
        token = CSRF_FIELD.search(http.get("/admin/login").text)[1]
        r = http.post("/admin/login", data={"csrf": token, "password": PASSWORD})
        assert r.status_code == 303, r.text
        return r.cookies[COOKIE]


def console(gw: GatewayProcess, cookie: str) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, cookies={COOKIE: cookie}, timeout=30)


def logged_in(gw: GatewayProcess, cookie: str) -> bool:
    with console(gw, cookie) as http:
        r = http.get("/admin/fleet")
    assert r.status_code in (200, 303), r.text
    return r.status_code == 200


def submit(
    gw: GatewayProcess, cookie: str, path: str, form: dict, expect: int = 200
) -> httpx.Response:
    """POST a console form with the session's CSRF token, as the page would."""
    with console(gw, cookie) as http:
        csrf = CSRF_FIELD.search(http.get("/admin/models").text)[1]
        r = http.post(path, data={**form, "csrf": csrf})
    assert r.status_code == expect, r.text
    return r


def keys(gw: GatewayProcess, *args: str) -> str:
    """`helexa keys ARGS` against `gw`'s config (so its database)."""
    out = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "keys", *args, "--config", str(config_of(gw))],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def model_ids(gw: GatewayProcess, secret: str) -> dict[str, dict] | int:
    """What `GET /v1/models` lists for `secret` by id, or the status when it is refused."""
    r = gw.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
    return {m["id"]: m for m in r.json()["data"]} if r.status_code == 200 else r.status_code


def eventually(check: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait until `check()` holds (polled every 20 ms). The deadline, 120 of the gateways'
    poll intervals, is a hang guard only: a loaded machine may take several to answer."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never seen in {timeout:g} s"
        time.sleep(0.02)


# -- in process -----------------------------------------------------------------------


@pytest.fixture
def sessions(db_url):
    """Sessions on a fresh database at the migrations' head: SQLite, then PostgreSQL."""
    upgrade(db_url)
    engine = make_engine(db_url)
    yield session_factory(engine)
    engine.dispose()


def synced(sessions) -> DatabaseSync:
    """A DatabaseSync over a router and key cache loaded from `sessions` now."""
    router = Router(Config(), Fleet([]), nodes=None)  # type: ignore[arg-type]  # never routes
    router.replace_catalogue(*edit.catalogue_rows(sessions))
    return DatabaseSync(sessions, router, Authenticator(KeyStore(sessions), require_auth=True))


def test_a_refresh_picks_up_catalogue_and_alias_edits_made_elsewhere(sessions):
    sync = synced(sessions)
    edit.add_model(sessions, ModelEntry(id="org/m"))
    edit.set_alias(sessions, "small", "org/m")
    assert sync.router.catalogue == {}
    asyncio.run(sync.refresh())
    assert list(sync.router.catalogue) == ["org/m"] and sync.router.aliases == {"small": "org/m"}
    generation = sync.router.catalogue_generation
    asyncio.run(sync.refresh())
    assert sync.router.catalogue_generation == generation  # unchanged: left as it is


def test_a_refresh_drops_the_key_cache_so_a_revocation_elsewhere_holds(sessions):
    sync = synced(sessions)
    info, secret = sync.auth.store.create("acme")
    bearer = {"authorization": f"Bearer {secret}"}

    async def scenario() -> None:
        assert (await sync.auth.authenticate(bearer)).key_id == info.id
        KeyStore(sessions).revoke(info.id)  # another gateway, or `helexa keys revoke`
        assert (await sync.auth.authenticate(bearer)).key_id == info.id  # cached
        await sync.refresh()
        with pytest.raises(HelexaError, match="not valid"):
            await sync.auth.authenticate(bearer)

    asyncio.run(scenario())


def test_an_edit_made_here_while_a_refresh_reads_is_not_undone(sessions, monkeypatch):
    sync = synced(sessions)
    read = edit.catalogue_rows

    def slow_read(db):
        rows = read(db)  # what the database said before this gateway's edit
        sync.router.replace_catalogue([ModelEntry(id="org/edited-here")], {})
        return rows

    monkeypatch.setattr(poller, "catalogue_rows", slow_read)
    asyncio.run(sync.refresh())
    assert list(sync.router.catalogue) == ["org/edited-here"]


def test_an_unreadable_database_keeps_the_catalogue_and_is_logged_once(sessions, tmp_path, caplog):
    edit.add_model(sessions, ModelEntry(id="org/m"))
    sync = synced(sessions)
    broken = make_engine(f"sqlite:///{tmp_path / 'not-migrated.db'}")  # no tables at all
    sync.sessions = session_factory(broken)
    with caplog.at_level(logging.INFO, logger="helexa.gateway.poller"):
        asyncio.run(sync.refresh())
        asyncio.run(sync.refresh())
        assert list(sync.router.catalogue) == ["org/m"]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "could not re-read the catalogue" in warnings[0].message
        sync.sessions = sessions
        edit.add_model(sessions, ModelEntry(id="org/n"))
        asyncio.run(sync.refresh())
    assert sorted(sync.router.catalogue) == ["org/m", "org/n"]
    assert "read from the database again" in caplog.text
    broken.dispose()


# -- real processes ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def pair(request, tmp_path_factory):
    """Gateways A and B on one database (a SQLite file, then PostgreSQL), in front of one
    node with a scripted model."""
    need_shared()
    tmp = tmp_path_factory.mktemp("replicas")
    if request.param == "sqlite":
        url, drop = f"sqlite:///{tmp / 'helexa.db'}", lambda: None
    else:
        cluster = request.getfixturevalue("postgres_cluster")
        name = f"replicas_{uuid.uuid4().hex}"
        url, drop = cluster.create_database(name), lambda: cluster.drop_database(name)
    model = scripted_model(tmp / "models", SCRIPT)
    node = start_node(tmp / "n1", [model])
    entry = {"id": str(model), "cost": {"input": 1.0, "output": 2.0}}
    a = gateway(tmp, url, {"n1": node}, models=[entry])
    b = gateway(tmp, url, {"n1": node}, models=[entry])
    yield a, b, str(model)
    a.stop()
    b.stop()
    node.stop(signal.SIGTERM)
    drop()


def test_a_login_survives_a_restart_of_the_gateway_on_the_same_database(tmp_path, db_url):
    nowhere = {"n1": f"http://127.0.0.1:{free_port()}"}
    gw = gateway(tmp_path, db_url, nowhere, wait_up=False)
    cookie = log_in(gw)
    assert logged_in(gw, cookie)
    gw.stop()
    again = gateway(tmp_path, db_url, nowhere, wait_up=False)
    try:
        assert logged_in(again, cookie)
        assert not logged_in(again, "not-a-session")
        submit(again, cookie, "/admin/logout", {}, expect=303)
        assert not logged_in(again, cookie)
    finally:
        again.stop()


def test_a_login_on_one_gateway_is_served_by_the_other_and_so_is_logging_out(pair):
    a, b, _ = pair
    cookie = log_in(a)
    assert logged_in(b, cookie)
    submit(b, cookie, "/admin/aliases", {"alias": "from-b", "target": pair[2]})  # CSRF holds
    submit(b, cookie, "/admin/aliases/delete", {"alias": "from-b"})
    submit(b, cookie, "/admin/logout", {}, expect=303)
    assert not logged_in(a, cookie)


def test_models_and_aliases_edited_through_one_gateway_reach_the_other(pair):
    a, b, model = pair
    cookie = log_in(a)
    secret = keys(a, "create", "--account", "acme").strip().splitlines()[-1]
    assert "org/new" not in model_ids(b, secret)

    submit(a, cookie, "/admin/models", {"id": "org/new", "cost_input": "3"})
    assert "org/new" in model_ids(a, secret)  # at once where it was made
    eventually(lambda: "org/new" in model_ids(b, secret))
    assert model_ids(b, secret)["org/new"]["cost"]["input"] == 3.0

    submit(a, cookie, "/admin/aliases", {"alias": "helexa/small", "target": "org/new"})
    assert model_ids(a, secret)["helexa/small"]["alias_of"] == "org/new"
    eventually(lambda: "helexa/small" in model_ids(b, secret))
    assert model_ids(b, secret)["helexa/small"]["alias_of"] == "org/new"

    submit(a, cookie, "/admin/aliases", {"alias": "helexa/small", "target": model})
    eventually(lambda: model_ids(b, secret)["helexa/small"]["alias_of"] == model)

    submit(a, cookie, "/admin/models/delete", {"id": "org/new"})
    assert "org/new" not in model_ids(a, secret)
    eventually(lambda: "org/new" not in model_ids(b, secret))
    submit(a, cookie, "/admin/aliases/delete", {"alias": "helexa/small"})


def test_a_keys_models_and_revocation_reach_the_other_gateway(pair):
    a, b, model = pair
    cookie = log_in(a)
    created = keys(a, "create", "--account", "acme", "--name", "narrowed")
    key_id = re.search(r"key_[0-9a-f]+", created)[0]
    secret = created.strip().splitlines()[-1]
    assert model in model_ids(b, secret)  # now cached on B

    submit(a, cookie, "/admin/keys/edit", {"id": key_id, "models": "helexa/none"})
    eventually(lambda: model not in model_ids(b, secret))

    keys(a, "revoke", key_id)
    eventually(lambda: model_ids(b, secret) == 401)


def test_a_budget_cut_through_one_gateway_reaches_the_other(pair):
    a, b, model = pair
    cookie = log_in(a)
    created = keys(a, "create", "--account", "acme", "--cap-tokens", "100000")
    key_id = re.search(r"key_[0-9a-f]+", created)[0]
    secret = created.strip().splitlines()[-1]
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def chat() -> httpx.Response:
        return b.post("/v1/chat/completions", body, headers={"Authorization": f"Bearer {secret}"})

    assert chat().status_code == 200  # the key, budget and all, is now cached on B
    submit(a, cookie, "/admin/keys/edit", {"id": key_id, "cap_tokens": "1"})
    eventually(lambda: chat().status_code == 429)
