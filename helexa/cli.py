"""`helexa`: the one command. Subcommands grow with the roles (serve, keys, bench, db)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from collections.abc import Sequence

from helexa import __version__
from helexa.config import Config, ConfigError, load_config
from helexa.errors import HelexaError


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="helexa.toml to read (default: $HELEXA_CONFIG, else built-in defaults)",
    )


def _engine_args(cfg: Config, model: str | None):
    """What `helexa chat` loads: `model`, else the first of [node] default_models, with
    that entry's options (a table's quant, dtype, revision...) checked as a node checks a
    load's, a hub id fetched from its [sources.*] hub with a progress bar on stderr."""
    import dataclasses

    from helexa.engine.loader.load import BUNDLED_MODEL_ID
    from helexa.node.fetching import fetch_ref
    from helexa.node.loading import engine_args, parse_load_options

    loads = cfg.node.default_loads()
    body = next((b for b in loads if b["model_id"] == model), None) if model else None
    if body is None:
        body = {"model_id": model} if model else (loads[0] if loads else None)
    body = body or {"model_id": BUNDLED_MODEL_ID}
    args = engine_args(cfg, parse_load_options(body))
    path = fetch_ref(cfg, body["model_id"], args.model, args, _progress_bar)
    if path == args.model:
        return args
    return dataclasses.replace(args, model=path, revision=None, gguf_quant=None)


def _progress_bar(progress) -> None:  # sources.fetch.Progress
    """A download's progress on stderr: one line redrawn on a terminal, else a line each."""
    done = progress.done >= progress.total
    if sys.stderr.isatty():
        print("\r\033[K" + progress.line(), end="\n" if done else "", file=sys.stderr, flush=True)
    else:
        print(progress.line(), file=sys.stderr, flush=True)


def cmd_chat(args: argparse.Namespace, cfg: Config) -> int:
    """One-shot chat: render the model's template, generate, print the answer."""
    from helexa.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM.from_args(_engine_args(cfg, args.model))
    t1 = time.perf_counter()
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.message})
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    out = llm.chat(messages, params)[0]
    t2 = time.perf_counter()
    print(out.text.strip())
    if args.verbose:
        n = len(out.token_ids)
        print(
            f"[model {llm.engine.loaded.path.name}: loaded in {t1 - t0:.1f}s; "
            f"{out.num_prompt_tokens} prompt + {n} completion tokens in {t2 - t1:.2f}s; "
            f"finish_reason={out.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _reachable(host: str) -> str:
    """The address to print for a listener: loopback for a wildcard bind."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _print_node_banner(host: str, port: int, models: list[str]) -> None:
    from helexa.engine.loader.load import BUNDLED_MODEL_ID

    url = f"http://{_reachable(host)}:{port}"
    model = models[0] if models else BUNDLED_MODEL_ID
    body = (
        f'{{"model": "{model}", "messages": '
        '[{"role": "user", "content": "What is the capital of France?"}]}'
    )
    print(
        f"helexa node on {url}  (OpenAI API: {url}/v1)\n"
        f"  models, loading in the background: {', '.join(models) or model}\n"
        f'  ready when `curl {url}/health` shows activation state "ready"\n'
        f"  try:  curl {url}/v1/chat/completions -H 'content-type: application/json' "
        f"-d '{body}'",
        flush=True,
    )


def _serve_node(args: argparse.Namespace, cfg: Config) -> int:
    import logging

    from helexa.node.security import exposure_problem, unauthenticated_warning
    from helexa.node.service import build_node
    from helexa.systemd import notify
    from helexa.web.node_app import create_node_app
    from helexa.web.node_guard import NodeGuard
    from helexa.web.server import serve

    node = cfg.node
    node.default_models = [*node.default_models, *args.model]  # default_loads dedupes
    host = args.host or node.host
    port = args.port if args.port is not None else node.port
    node.listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    problem = exposure_problem(host, port, node)
    if problem is not None:
        print(f"helexa: {problem}", file=sys.stderr)
        return 2
    log = logging.getLogger("helexa.node")
    if node.gateway_secret:
        log.warning("[node] gateway_secret is deprecated: rename it to api_key")
    warning = unauthenticated_warning(host, node)
    if warning:
        log.warning(warning)
    service = build_node(cfg)
    service.on_progress = lambda line: notify(f"STATUS={line}")
    app = create_node_app(service)
    _print_node_banner(host, port, node.default_model_ids())

    def drain() -> None:
        service.draining = True

    return serve(
        NodeGuard(app, node),
        host,
        port,
        drain_timeout_s=node.drain_timeout_s,
        http=cfg.http,
        write_timeout_s=node.stream_write_timeout_s,
        on_exit=drain,
        ready=service.ready,  # READY=1 once the default models' load has ended
    )


def cmd_serve(args: argparse.Namespace, cfg: Config) -> int:
    """Run a role's HTTP service until SIGTERM/SIGINT, then leave at once: by then every
    request has drained, the workers have stopped and the books are written, and the
    interpreter's own teardown (torch's modules, ~0.5 s) would only delay a restart."""
    code = _serve(args, cfg)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(args: argparse.Namespace, cfg: Config) -> int:
    from helexa.logs import configure

    configure(cfg.log)
    from helexa.web.server import serve

    if args.role == "node":
        return _serve_node(args, cfg)
    from helexa.gateway.service import quiet_collector
    from helexa.web.gateway_app import create_gateway_apps
    from helexa.web.gateway_lane import Lane, lane_protocol

    gw = cfg.gateway
    host = args.host or gw.host
    port = args.port if args.port is not None else gw.port
    if args.model:
        raise ValueError("--model is a node option; the gateway's models are its [[models]]")
    api, metrics_app = create_gateway_apps(cfg)
    quiet_collector()
    shown, mhost = _reachable(host), _reachable(gw.metrics_host)
    print(
        f"helexa gateway on http://{shown}:{port}  (OpenAI API: http://{shown}:{port}/v1; "
        f"metrics: http://{mhost}:{gw.metrics_port}/metrics)\n"
        f"  nodes: {', '.join(f'{n.name}={n.endpoint}' for n in cfg.nodes) or 'none configured'}",
        flush=True,
    )

    async def ready() -> str:
        return f"serving on http://{shown}:{port} (metrics on port {gw.metrics_port})"

    return serve(
        api,
        host,
        port,
        drain_timeout_s=cfg.node.drain_timeout_s,
        http=cfg.http,
        companions=[(metrics_app, gw.metrics_host, gw.metrics_port)],
        ready=ready,
        protocol=lane_protocol(Lane(api)),  # the pass-through routes past ASGI
    )


def cmd_acp(args: argparse.Namespace, cfg: Config | None) -> int:
    """`helexa acp`: the editor agent on stdin/stdout (docs/acp.md); its log on stderr (and
    in $HELEXA_ACP_LOG_FILE when set), never on stdout, which is the protocol's."""
    import asyncio
    from pathlib import Path

    from helexa.acp.config import AcpConfigError
    from helexa.acp.config import load_config as load_endpoints

    try:
        endpoints = load_endpoints(Path(args.endpoints) if args.endpoints else None)
    except AcpConfigError as e:
        print(f"helexa acp: {e}", file=sys.stderr)
        return 2
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if os.environ.get("HELEXA_ACP_LOG_FILE"):
        handlers.append(logging.FileHandler(os.environ["HELEXA_ACP_LOG_FILE"]))
    logging.basicConfig(
        level=logging.INFO,
        handlers=handlers,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from acp import run_agent

    from helexa.acp.agent import MAX_ROUNDS, HelexaAgent

    rounds = os.environ.get("HELEXA_ACP_MAX_ROUNDS", "")
    if rounds and (not rounds.isdigit() or int(rounds) < 1):
        print(
            f"helexa acp: HELEXA_ACP_MAX_ROUNDS: expected a positive number, got {rounds!r}",
            file=sys.stderr,
        )
        return 2
    agent = HelexaAgent(endpoints, max_rounds=int(rounds) if rounds else MAX_ROUNDS)
    asyncio.run(run_agent(agent))
    return 0


def cmd_config(args: argparse.Namespace, cfg: Config) -> int:
    """Print the effective configuration (file + environment), secrets left out."""
    print(cfg)
    return 0


def cmd_db(args: argparse.Namespace, cfg: Config) -> int:
    """`helexa db upgrade|downgrade|current` on [gateway] database_url."""
    from alembic.util import CommandError
    from sqlalchemy import make_url

    from helexa.db import session

    url = cfg.gateway.database_url
    shown = make_url(url).render_as_string(hide_password=True)
    before = session.current(url)
    try:
        if args.db_command == "upgrade":
            session.upgrade(url, args.revision)
        elif args.db_command == "downgrade":
            session.downgrade(url, args.revision)
    except CommandError as e:  # e.g. an unknown revision
        raise ValueError(f"{shown}: {e}") from None
    after = session.current(url)
    if args.db_command == "current":
        print(f"{shown}: at revision {after or 'none (empty database)'}")
    elif before == after:
        print(f"{shown}: already at revision {after or 'none'}")
    else:
        print(f"{shown}: {args.db_command}d from {before or 'none'} to {after or 'none'}")
    return 0


def _key_store(cfg: Config):
    from helexa.db.session import open_database
    from helexa.gateway.keys import KeyStore

    _, sessions = open_database(cfg)
    return KeyStore(sessions)


def _split_models(text: str | None) -> list[str] | None:
    return None if text is None else text.split(",")


def cmd_keys(args: argparse.Namespace, cfg: Config) -> int:
    """`helexa keys create|list|revoke|set-budget`: secrets are printed once, by create."""
    from helexa.gateway.keys import describe_key, format_keys

    store = _key_store(cfg)
    if args.keys_command == "create":
        info, secret = store.create(
            args.account,
            name=args.name,
            models=_split_models(args.models),
            cap_tokens=args.cap_tokens,
            cap_cost_usd=args.cap_cost,
            window=args.window,
        )
        print(describe_key(info))
        print("secret (shown once; store it now):")
        print(secret)
    elif args.keys_command == "list":
        print(format_keys(store.list(account=args.account)))
    elif args.keys_command == "revoke":
        if not store.revoke(args.id):
            known = store.get(args.id) is not None
            raise ValueError(f"key {args.id!r} is {'already revoked' if known else 'unknown'}")
        print(f"revoked {args.id}")
    else:
        try:
            info = store.set_budget(
                args.id, cap_tokens=args.cap_tokens, cap_cost_usd=args.cap_cost, window=args.window
            )
        except KeyError:
            raise ValueError(f"unknown key {args.id!r}; see `helexa keys list`") from None
        print(describe_key(info))
    return 0


def cmd_spend(args: argparse.Namespace, cfg: Config) -> int:
    """Ledger totals per key, and a grand total."""
    from helexa.gateway.spend_report import format_spend, parse_since

    since = parse_since(args.since) if args.since else None
    rows = _key_store(cfg).spend_totals(key_id=args.key, account=args.account, since=since)
    print(format_spend(rows))
    return 0


def cmd_admin(args: argparse.Namespace, cfg: Config) -> int:
    """`helexa admin hash-password`: a hash for `[admin] password_hash`."""
    import getpass

    from helexa.passwords import hash_password

    if args.stdin or not sys.stdin.isatty():
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = getpass.getpass("admin password: ")
        if getpass.getpass("again: ") != password:
            raise ValueError("the two passwords differ; nothing was hashed")
    print(hash_password(password))
    print('put it in helexa.toml:  [admin] password_hash = "<the line above>"', file=sys.stderr)
    return 0


# `helexa bench SUITE`: (name, help, module, its add-arguments function, its entry point)
BENCH_SUITES = [
    ("engine", "TTFT and decode throughput of the in-process engine",
     "helexa.bench.engine", "add_arguments", "main"),
    ("speculative", "decode with speculative decoding off and on: a code edit, a batch",
     "helexa.bench.speculative", "add_arguments", "main"),
    ("gpu", "decode vs memory bandwidth, TTFT and throughput on random Qwen3 weights",
     "helexa.bench.gpu", "add_arguments", "main"),
    ("node", "what the node's HTTP layer costs", "helexa.bench.node", "add_arguments", "main"),
    ("gguf", "write a GGUF in a real checkpoint's shapes (random blocks) to measure with",
     "helexa.bench.gguf_writer", "add_arguments", "main"),
    ("grammar", "llguidance vs xgrammar: compile, mask and decode cost of JSON schemas",
     "helexa.bench.grammar", "add_arguments", "main"),
    ("run", "the SPEC's scenarios against any OpenAI-compatible server, kept in the database",
     "helexa.bench.harness", "add_run_arguments", "main_run"),
    ("report", "Markdown table of the latest bench figures, with the change per build",
     "helexa.bench.harness", "add_report_arguments", "main_report"),
]  # fmt: skip


def build_parser(with_bench: bool | str = True) -> argparse.ArgumentParser:
    """The command line. `with_bench=False` leaves out the bench suites' own options (their
    modules import torch, which `helexa serve --role gateway` or `helexa keys` never need);
    a suite's name imports that suite's module alone (`helexa bench gpu` on a GPU host needs
    neither the database of `bench run` nor the HTTP clients of `bench node`)."""
    parser = argparse.ArgumentParser(
        prog="helexa",
        description="Self-hosted serving of open-weight LLMs: inference nodes and a fleet gateway.",
    )
    parser.add_argument("--version", action="version", version=f"helexa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    chat = sub.add_parser("chat", help="one-shot chat with a model (default: the bundled SmolLM2)")
    _add_config_arg(chat)
    chat.add_argument(
        "message", nargs="?", default="What is the capital of France? Answer in one word."
    )
    chat.add_argument("--model", help="local dir, .gguf file or hub id (default: bundled SmolLM2)")
    chat.add_argument("--system", help="system message")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int)
    chat.add_argument("-v", "--verbose", action="store_true", help="print timing to stderr")
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="SUITE")
    for name, help_text, module, add_name, main_name in BENCH_SUITES:
        suite = bench_sub.add_parser(name, help=help_text)
        _add_config_arg(suite)
        if with_bench is True or with_bench == name:  # only when a bench command runs
            mod = importlib.import_module(module)
            getattr(mod, add_name)(suite)
            suite.set_defaults(func=getattr(mod, main_name))

    serve = sub.add_parser("serve", help="run the node's or the gateway's HTTP service")
    _add_config_arg(serve)
    serve.add_argument(
        "--role", choices=["node", "gateway"], required=True, help="which service to run"
    )
    serve.add_argument("--host", help="address to bind (default: the role's `listen`)")
    serve.add_argument("--port", type=int, help="port to bind (default: the role's `listen`)")
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="ID",
        help="model to load at start, added to default_models (repeatable)",
    )
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", help="API keys: create, list, revoke, set-budget")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = keys_sub.add_parser("create", help="create a key; prints its secret once, last")
    create.add_argument("--account", required=True, help="account the key belongs to")
    create.add_argument("--name", help="a label for the key")
    create.add_argument("--models", metavar="M1,M2", help="only these models (default: every)")
    listing = keys_sub.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--account", help="only this account's keys")
    revoke = keys_sub.add_parser("revoke", help="revoke a key")
    revoke.add_argument("id", metavar="ID")
    budget = keys_sub.add_parser("set-budget", help="replace a key's budget (no caps: remove it)")
    budget.add_argument("id", metavar="ID")
    for p in (create, budget):
        p.add_argument("--cap-tokens", type=int, metavar="N", help="cap in tokens")
        p.add_argument("--cap-cost", type=float, metavar="USD", help="cap in USD")
        p.add_argument("--window", default="balance", help="balance (default) or rolling:SECONDS")
    for p in (create, listing, revoke, budget):
        _add_config_arg(p)
    keys.set_defaults(func=cmd_keys)

    spend = sub.add_parser("spend", help="what each key spent, from the ledger")
    _add_config_arg(spend)
    spend.add_argument("--key", metavar="ID", help="only this key")
    spend.add_argument("--account", help="only this account")
    spend.add_argument("--since", help="2026-11-01, an ISO date-time, or 24h / 7d back from now")
    spend.set_defaults(func=cmd_spend)

    db = sub.add_parser("db", help="the gateway's database: migrate it, show its revision")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db_up = db_sub.add_parser("upgrade", help="migrate to the newest schema (or REV)")
    db_up.add_argument("revision", nargs="?", default="head", metavar="REV")
    db_down = db_sub.add_parser("downgrade", help="migrate back to REV ('base': drop all)")
    db_down.add_argument("revision", metavar="REV")
    db_current = db_sub.add_parser("current", help="print the database's revision")
    for p in (db_up, db_down, db_current):
        _add_config_arg(p)
    db.set_defaults(func=cmd_db)

    admin = sub.add_parser("admin", help="the /admin console: hash its password")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True, metavar="ACTION")
    hash_pw = admin_sub.add_parser(
        "hash-password", help="print a hash of the admin password for [admin] password_hash"
    )
    hash_pw.add_argument(
        "--stdin", action="store_true", help="read the password from stdin instead of prompting"
    )
    admin.set_defaults(func=cmd_admin)

    agent = sub.add_parser("acp", help="the coding agent for ACP editors (Zed), on stdio")
    agent.add_argument(
        "--endpoints", metavar="PATH",
        help="the model endpoints' TOML (default: ~/.config/helexa/acp.toml, else HELEXA_ACP_*)",
    )  # fmt: skip
    agent.set_defaults(func=cmd_acp)

    show = sub.add_parser("config", help="print the effective configuration")
    _add_config_arg(show)
    show.set_defaults(func=cmd_config)
    return parser


def _bench_suite(argv: Sequence[str]) -> bool | str:
    """Which bench suites `argv` needs: the one it names, every one for `helexa bench`
    alone (its help lists them all), none for any other command."""
    if argv[:1] != ["bench"]:
        return False
    names = {suite[0] for suite in BENCH_SUITES}
    return argv[1] if len(argv) > 1 and argv[1] in names else True


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(with_bench=_bench_suite(argv)).parse_args(argv)
    if args.func is cmd_acp:  # a client of the APIs: helexa.toml is the servers' file
        return cmd_acp(args, None)
    try:
        cfg = load_config(getattr(args, "config", None))
    except ConfigError as e:
        print(f"helexa: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args, cfg)
    except (FileNotFoundError, ValueError) as e:
        print(f"helexa: {e}", file=sys.stderr)
        return 1
    except HelexaError as e:  # a model `helexa chat` cannot load, as a node would refuse it
        hint = (e.extra or {}).get("suggestion")
        print(f"helexa: {e.message}" + (f" ({hint})" if hint else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
