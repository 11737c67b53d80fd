"""`python scripts/screenshots.py`: the admin console's pages as PNGs in docs/screenshots/.

Starts a real node (the bundled SmolLM2-135M) and a real gateway in front of it on a
temporary database seeded with a few keys, a week of ledger rows and five builds' worth of
bench history for two targets, sends a few real requests and runs a real quick `helexa bench
run` against the node, then photographs every page with Playwright and Debian chromium at desktop width,
and the Keys and Spend pages at phone width (390 px). Both processes stop at the end.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.admin_spend import free_port, insert_ledger_rows  # noqa: E402
from helexa.bench import history as bh  # noqa: E402
from helexa.db.session import make_engine, session_factory, upgrade  # noqa: E402
from helexa.gateway.keys import KeyStore  # noqa: E402

OUT = ROOT / "docs" / "screenshots"
PASSWORD = "screenshots"
BUNDLED = "SmolLM2-135M-Instruct"
CATALOGUE = [
    (BUNDLED, 'cost = { input = 0.02, output = 0.05 }\npinned_on = ["gpu-a"]'),
    ("Qwen/Qwen3-8B", 'quant = "Q4_K_M"\ncost = { input = 0.05, output = 0.20 }'),
    ("Qwen/Qwen3-1.7B", "cost = { input = 0.01, output = 0.04 }"),
]


def seed(db: Path) -> None:
    """Three keys with budgets and a week of plausible ledger rows."""
    upgrade(f"sqlite:///{db}")
    engine = make_engine(f"sqlite:///{db}")
    store = KeyStore(session_factory(engine))
    keys = [
        store.create("research", name="notebooks", cap_tokens=5_000_000)[0],
        store.create("research", name="ci", cap_cost_usd=2.0, window="rolling:86400")[0],
        store.create("support-bot", name="prod", models=[BUNDLED, "Qwen/Qwen3-8B"])[0],
    ]
    engine.dispose()
    rng = random.Random(7)
    now = datetime.now(UTC)
    rows = []
    for i in range(3000):
        ts = now - timedelta(days=7) + timedelta(seconds=7 * 86400 * i / 3000)
        busy = 1.0 + 0.8 * (9 <= ts.hour <= 18)  # office hours
        if rng.random() > busy / 1.8:
            continue
        key = None if rng.random() < 0.1 else rng.choice(keys)
        model, (cin, cout) = rng.choice(
            [
                (BUNDLED, (0.02, 0.05)),
                ("Qwen/Qwen3-8B", (0.05, 0.2)),
                ("Qwen/Qwen3-1.7B", (0.01, 0.04)),
            ]
        )
        prompt, completion = rng.randint(40, 3000), rng.randint(5, 600)
        rows.append(
            (
                ts.strftime("%Y-%m-%d %H:%M:%S.%f"),
                key.account_id if key else None,
                key.id if key else None,
                model,
                rng.choice(["gpu-a", "gpu-b"]),
                prompt,
                completion,
                (prompt * cin + completion * cout) / 1e6,
                200 if rng.random() > 0.03 else 429,
                rng.uniform(30, 300),
                rng.uniform(200, 6000),
            )
        )
    insert_ledger_rows(db, rows)
    seed_bench(db, rng)


def seed_bench(db: Path, rng: random.Random) -> None:
    """Five builds of a GPU node and of a llama-server beside it, three samples a cell."""
    engine = make_engine(f"sqlite:///{db}")
    sessions = session_factory(engine)
    start = datetime.now(UTC) - timedelta(days=10)
    for b in range(5):
        for target, speed in (("gpu-a", 1.0 + 0.08 * b), ("llama-server", 0.95)):
            sha = f"{rng.getrandbits(160):040x}" if target == "gpu-a" else f"b{4100 + b}"
            build = bh.Build(sha, False)
            run = bh.start_run(
                sessions,
                target=target,
                target_url="http://gpu-a:13131/v1",
                build=build,
                build_info=None,
                host="bench",
                quick=False,
            )
            for i in range(3):
                ts = start + timedelta(days=2 * b, minutes=i)
                jitter = rng.uniform(0.97, 1.03)
                for scenario, prompt, c, metrics in (
                    ("chat-128", 128, 1, {"ttft_ms": 38 / speed, "decode_tok_s": 92 * speed}),
                    ("chat-4096", 4096, 1, {"ttft_ms": 610 / speed, "decode_tok_s": 85 * speed}),
                    ("throughput-c16", 128, 16, {"tok_s": 980 * speed, "latency_ms": 2100 / speed}),
                ):
                    bh.record_sample(
                        sessions,
                        run,
                        ts=ts,
                        target=target,
                        sha=sha,
                        dirty=False,
                        model="Qwen/Qwen3-8B",
                        scenario=scenario,
                        concurrency=c,
                        requests=2 * c,
                        prompt_tokens=prompt,
                        completion_tokens=256 * c,
                        wall_s=10.0,
                        **{k: v * jitter for k, v in metrics.items()},
                    )
    engine.dispose()


def start(tmp: Path) -> tuple[list[subprocess.Popen], str]:
    node_port, port, mport = free_port(), free_port(), free_port()
    cfg = tmp / "helexa.toml"
    cfg.write_text(
        f'[node]\nlisten = "127.0.0.1:{node_port}"\nstate_dir = "{tmp}"\nper_principal_max = 0\n'
        f"[engine]\nkv_cache_memory_mb = 64\n"
        f'[gateway]\nlisten = "127.0.0.1:{port}"\nmetrics_listen = "127.0.0.1:{mport}"\n'
        f'database_url = "sqlite:///{tmp / "helexa.db"}"\npoll_interval_s = 1.0\n'
        f'[[nodes]]\nname = "gpu-a"\nendpoint = "http://127.0.0.1:{node_port}"\n'
        f'[[nodes]]\nname = "gpu-b"\nendpoint = "http://127.0.0.1:{free_port()}"\n'
        + "".join(f'[[models]]\nid = "{m}"\n{extra}\n' for m, extra in CATALOGUE)
        + '[aliases]\n"helexa/small" = "Qwen/Qwen3-1.7B"\n'
    )
    env = {**os.environ, "HELEXA_ADMIN_PASSWORD": PASSWORD}
    env.pop("HELEXA_CONFIG", None)
    procs = []
    for role in ("node", "gateway"):
        log = (tmp / f"{role}.log").open("wb")
        cmd = [sys.executable, "-m", "helexa.cli", "serve", "--role", role, "--config", str(cfg)]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).json()["nodes_up"] == 1:
                return procs, base
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError((tmp / "node.log").read_text()[-2000:] + (tmp / "gateway.log").read_text())


def procs_node_url(tmp: Path) -> str:
    listen = re.search(r'listen = "([^"]+)"', (tmp / "helexa.toml").read_text())[1]
    return f"http://{listen}/v1"


def main() -> int:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium on PATH: apt-get install chromium", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        seed(tmp / "helexa.db")
        procs, base = start(tmp)
        try:
            for _ in range(3):  # a few real rows beside the seeded ones
                httpx.post(
                    base + "/v1/chat/completions",
                    json={"model": BUNDLED, "messages": [{"role": "user", "content": "Hi"}]},
                    timeout=120,
                )
            bench = [sys.executable, "-m", "helexa.cli", "bench", "run", "--quick"]
            bench += ["--target", procs_node_url(tmp), "--target-name", "gpu-a"]
            bench += ["--scenario", "chat-128,throughput-c4", "--config", str(tmp / "helexa.toml")]
            subprocess.run(bench, check=True, timeout=600)
            shoot(chromium, base)
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    return 0


def shoot(chromium: str, base: str) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        context = browser.new_context(base_url=base, viewport={"width": 1280, "height": 800})
        page = context.new_page()
        page.goto("/admin/login")
        page.screenshot(path=OUT / "login.png")
        page.get_by_label("Admin password").fill(PASSWORD)
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url("**/admin/fleet")
        page.locator("article.node").first.wait_for()
        page.screenshot(path=OUT / "fleet.png", full_page=True)
        page.goto("/admin/models")
        page.get_by_text("Edit").first.click()  # one entry's edit form, open
        page.screenshot(path=OUT / "models.png", full_page=True)
        page.goto("/admin/keys")
        page.get_by_label("Account").fill("support-bot")
        page.locator("#new-name").fill("staging")
        page.locator("#new-tokens").fill("250000")
        page.get_by_role("button", name="Create key").click()
        page.locator("#new-secret").wait_for()
        page.screenshot(path=OUT / "keys.png", full_page=True)
        page.goto("/admin/spend?since=7d")
        page.screenshot(path=OUT / "spend.png", full_page=True)
        key = re.search(r"key_\w+", page.locator("#f-key option").nth(2).inner_text())
        if key:
            page.goto(f"/admin/spend?key={key[0]}&since=7d")
            page.screenshot(path=OUT / "spend-filtered.png", full_page=True)
        page.goto("/admin/bench")
        page.screenshot(path=OUT / "bench.png", full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.goto("/admin/spend?since=7d")
        page.screenshot(path=OUT / "spend-phone.png", full_page=True)
        page.goto("/admin/fleet")
        page.screenshot(path=OUT / "fleet-phone.png", full_page=True)
        browser.close()
    print("\n".join(str(p.relative_to(ROOT)) for p in sorted(OUT.glob("*.png"))))


if __name__ == "__main__":
    sys.exit(main())
