"""`python bench/admin_spend.py`: how fast the admin console's pages answer over a big ledger.

Seeds a temporary SQLite database (migrated by Alembic) with 100,000 spend-ledger rows over
30 days (50 keys in 10 accounts, 8 models, every tenth request anonymous), starts a real
gateway process on it, logs in, and times each page server-side-to-client with one client
sending requests back to back: the Spend page unfiltered, filtered by key, by model and a
week, by account and a day, a page deep in the ledger, and the other pages. Prints p50 and
p95 in milliseconds. The gateway is always stopped at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helexa.db.session import make_engine, session_factory, upgrade  # noqa: E402
from helexa.gateway.keys import KeyStore  # noqa: E402

PASSWORD = "bench"
MODELS = [f"org/model-{i}" for i in range(8)]


def seed(db: Path, rows: int, seed_value: int = 0) -> list[str]:
    """Migrate `db`, make 50 keys and `rows` ledger rows; returns the key ids."""
    url = f"sqlite:///{db}"
    upgrade(url)
    engine = make_engine(url)
    store = KeyStore(session_factory(engine))
    keys = [
        store.create(f"account-{i % 10}", name=f"bench {i}", cap_tokens=10**9)[0] for i in range(50)
    ]
    engine.dispose()
    rng = random.Random(seed_value)
    end = datetime.now(UTC)
    span = timedelta(days=30).total_seconds()
    data = []
    for i in range(rows):
        ts = end - timedelta(seconds=span * (1 - i / rows))
        key = None if i % 10 == 0 else keys[rng.randrange(len(keys))]
        prompt, completion = rng.randint(10, 4000), rng.randint(1, 800)
        data.append(
            (
                ts.strftime("%Y-%m-%d %H:%M:%S.%f"),
                key.account_id if key else None,
                key.id if key else None,
                rng.choice(MODELS),
                "n1",
                prompt,
                completion,
                (prompt * 0.1 + completion * 0.4) / 1e6,
                200,
                rng.uniform(20, 400),
                rng.uniform(100, 9000),
            )
        )
    insert_ledger_rows(db, data)
    return [k.id for k in keys]


def insert_ledger_rows(db: Path, rows: list[tuple]) -> None:
    """Ledger rows written in one go (the ORM would take minutes for 100,000): each
    (ts, account, key, model, node, prompt, completion, cost, status, ttft_ms, latency_ms)."""
    with sqlite3.connect(db) as conn:
        conn.executemany(
            "INSERT INTO spend_ledger (ts, account_id, key_id, model, node, prompt_tokens,"
            " completion_tokens, cached_tokens, reasoning_tokens, cost_usd, status, ttft_ms,"
            " latency_ms) VALUES (?, ?, ?, ?, ?, ?, ?, 0, 0, ?, ?, ?, ?)",
            rows,
        )
        conn.execute("ANALYZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(tmp: Path) -> tuple[subprocess.Popen, str]:
    port, mport = free_port(), free_port()
    cfg = tmp / "gateway.toml"
    cfg.write_text(
        f'[node]\nstate_dir = "{tmp}"\n'
        f'[gateway]\nlisten = "127.0.0.1:{port}"\nmetrics_listen = "127.0.0.1:{mport}"\n'
        f'database_url = "sqlite:///{tmp / "bench.db"}"\n'
        + "".join(f'[[models]]\nid = "{m}"\n' for m in MODELS)
    )
    env = {**os.environ, "HELEXA_ADMIN_PASSWORD": PASSWORD}
    env.pop("HELEXA_CONFIG", None)
    log = (tmp / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "helexa.cli", "serve", "--role", "gateway", "--config", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp / "gateway.log").read_text())
        try:
            httpx.get(base + "/health", timeout=2)
            return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("the gateway did not start")


def log_in(client: httpx.Client) -> None:
    page = client.get("/admin/login").text
    token = re.search(r'name="csrf" value="([^"]+)"', page)[1]
    r = client.post("/admin/login", data={"csrf": token, "password": PASSWORD})
    assert r.status_code == 303, r.text


def timed(client: httpx.Client, path: str, n: int) -> tuple[float, float]:
    for _ in range(3):  # warm caches and the connection
        client.get(path).raise_for_status()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.get(path)
        times.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("-n", type=int, default=40, help="timed requests per page")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        keys = seed(tmp / "bench.db", args.rows)
        print(f"seeded {args.rows:,} ledger rows in {time.perf_counter() - t0:.1f} s")
        proc, base = start_gateway(tmp)
        try:
            with httpx.Client(base_url=base, timeout=30) as client:
                log_in(client)
                deep = client.get("/admin/spend").text  # an id near the oldest rows
                cases = {
                    "spend, no filter": "/admin/spend",
                    "spend, one key": f"/admin/spend?key={keys[7]}",
                    "spend, one model, last 7 days": f"/admin/spend?model={MODELS[3]}&since=7d",
                    "spend, one account, last 24 h": "/admin/spend?account=account-4&since=24h",
                    "spend, anonymous only": "/admin/spend?key=(anonymous)",
                    "spend, 1,950 pages deep": "/admin/spend?before=2550",
                    "fleet": "/admin/fleet",
                    "models": "/admin/models",
                    "keys (50, spend against cap)": "/admin/keys",
                }
                assert "Older" in deep
                print(f"{'page':<34} {'p50 ms':>8} {'p95 ms':>8}")
                for name, path in cases.items():
                    p50, p95 = timed(client, path, args.n)
                    print(f"{name:<34} {p50:8.1f} {p95:8.1f}")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
