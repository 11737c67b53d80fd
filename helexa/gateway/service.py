"""The gateway as one object: what its handlers use, built whole from the config by
`build_gateway` (the database opened and migrated, the catalogue seeded and loaded), then
`start()`ed on the running loop (the connection pool, the poller, the ledger's writer and
its retention) and `stop()`ped at shutdown (every pending ledger row written)."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from helexa.config import Config
from helexa.db.seed import load_catalogue, seed_catalogue
from helexa.db.session import open_database
from helexa.gateway.accounting import Accountant
from helexa.gateway.admin_auth import Console
from helexa.gateway.auth import Authenticator
from helexa.gateway.budgets import Budgets
from helexa.gateway.connections import Connections
from helexa.gateway.exchange import Exchanges
from helexa.gateway.fleet import Fleet
from helexa.gateway.keys import KeyStore
from helexa.gateway.ledger import Ledger
from helexa.gateway.metrics import GatewayMetrics
from helexa.gateway.model_jobs import ModelJobs
from helexa.gateway.poller import DatabaseSync, NodeCalls, Poller
from helexa.gateway.proxy import Upstream
from helexa.gateway.purses import Purses
from helexa.gateway.retention import Retention
from helexa.gateway.router import Router

log = logging.getLogger(__name__)

YOUNG_COLLECTION_THRESHOLD = 5_000  # allocations less deallocations (Python's default: 700)


@dataclass(slots=True, frozen=True)
class Gateway:
    cfg: Config
    fleet: Fleet
    metrics: GatewayMetrics
    sessions: sessionmaker[Session]  # the database: keys, budgets, ledger, catalogue
    keys: KeyStore
    auth: Authenticator
    budgets: Budgets
    ledger: Ledger
    router: Router
    exchanges: Exchanges
    jobs: ModelJobs  # loads and unloads asked for on the admin console
    console: Console
    connections: Connections
    poller: Poller
    retention: Retention  # prunes the ledger past [gateway] ledger_retention_days
    started_at: int = field(default_factory=lambda: int(time.time()))

    async def start(self) -> None:
        """What needs the running loop: the pool to the nodes, the poller, the books'
        writer, this gateway's reservation lease and the ledger's pruning."""
        await self.connections.open()
        self.ledger.start()
        self.budgets.start()
        self.retention.start()
        self.poller.start()

    async def stop(self) -> None:
        try:
            await self.poller.stop()
            await self.exchanges.drain()  # cut exchanges still asking their node
            await self.budgets.stop()
            await self.retention.stop()
            await self.ledger.close()  # every pending row is written before we exit
        finally:
            await self.connections.close()


def quiet_collector() -> None:
    """Keep Python's cyclic collector off the request path's tail, in a gateway process
    (`helexa serve` calls it once the gateway is built; never in a process that builds and
    drops gateways, whose frozen garbage would never be collected). What was built to start
    (the app, its routes and templates, SQLAlchemy's mappers, the catalogue: hundreds of
    thousands of objects that live as long as the process) is frozen out of its full
    collections, each of which walked all of them: 100-150 ms with every request on hold,
    which made the p99 under load. Requests make short-lived garbage, so the youngest
    generation is collected every few thousand allocations rather than every 700."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, older, oldest)


def build_gateway(cfg: Config) -> Gateway:
    """The whole gateway for `cfg`, not yet started."""
    _warn_about_node_keys(cfg)
    fleet = Fleet([(n.name, n.endpoint) for n in cfg.nodes], {n.name: n.api_key for n in cfg.nodes})
    metrics = GatewayMetrics(fleet)
    engine, sessions = open_database(cfg)
    with sessions() as db:
        if seed_catalogue(db, cfg):
            log.info("catalogue seeded from the config: %d models", len(cfg.models))
        catalogue, aliases = load_catalogue(db)
    connections = Connections()
    poller = Poller(fleet, connections, cfg.gateway.poll_interval_s)
    router = Router(cfg, fleet, NodeCalls(connections, poller))
    router.replace_catalogue(catalogue, aliases)
    g = cfg.gateway
    keys = KeyStore(sessions)
    auth = Authenticator(keys, require_auth=cfg.gateway.require_auth)
    # edits made through another gateway (or `helexa keys`) reach this one every interval
    poller.also_every_interval(DatabaseSync(sessions, router, auth).refresh)
    ledger = Ledger.over(engine)
    ledger.backlog_max = g.ledger_backlog_max
    budgets = Budgets(
        ledger, lease_s=g.reservation_lease_s, database_timeout_s=g.database_timeout_s
    )
    Purses(budgets)  # what metered requests draw on: it registers itself as budgets.purses
    accountant = Accountant(budgets, ledger, metrics)
    metrics.watch_books(ledger, budgets)
    return Gateway(
        cfg=cfg,
        fleet=fleet,
        metrics=metrics,
        sessions=sessions,
        keys=keys,
        auth=auth,
        budgets=budgets,
        ledger=ledger,
        router=router,
        exchanges=Exchanges(
            router, Upstream(connections, g.upstream_idle_timeout_s), budgets, accountant, metrics
        ),
        jobs=ModelJobs(router),
        console=Console.from_config(cfg.admin),
        connections=connections,
        poller=poller,
        retention=Retention(ledger, g.ledger_retention_days),
    )


def _warn_about_node_keys(cfg: Config) -> None:
    """Say at start what would otherwise show up only as nodes refusing the gateway."""
    if cfg.node.gateway_secret:
        log.warning(
            "[node] gateway_secret is deprecated and will be removed in the next release: it "
            "is read as [node] api_key (the key the gateway sends its nodes); rename it"
        )
    for n in cfg.nodes:
        if n.api_key is None and n.api_key_env:
            log.warning(
                "node %s: api_key_env %s is not set; calls to it carry no key",
                n.name,
                n.api_key_env,
            )
