"""The admin console in a real browser (Debian chromium through Playwright) against a real
gateway process in front of a real node: login, keys, budgets, the catalogue, loading a
model, the ledger, CSRF refusals, escaping, phone width and the keyboard."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from helexa.bench import history as bh
from helexa.db.session import make_engine, session_factory
from helexa.passwords import hash_password
from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import start_node

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PASSWORD = "correct horse battery"
XSS_ID = "evil/<script>alert(1)</script>"

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; .ci/run does)"
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("admin")
    node = start_node(tmp / "n1", [model_dirs["scripted"]])
    gw = start_gateway(
        tmp,
        {"n1": node},
        models=[{"id": str(model_dirs["scripted"]), "cost": {"input": 1.0, "output": 2.0}}],
        gateway={"require_auth": True},
        admin={"password_hash": hash_password(PASSWORD), "session_ttl_s": 3600},
    )
    yield gw, node
    gw.stop()
    node.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, fleet):
    """One logged-in tab most tests share."""
    gw, _ = fleet
    context = browser.new_context(base_url=gw.base_url)
    context.set_default_timeout(20_000)
    tab = context.new_page()
    log_in(tab)
    yield tab
    context.close()


def log_in(tab, password: str = PASSWORD) -> None:
    tab.goto("/admin/login")
    tab.get_by_label("Admin password").fill(password)
    tab.get_by_role("button", name="Log in").click()


def chat(gw, secret: str | None, model: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return httpx.post(gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60)


def wait_for(check, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def create_key(tab, account: str, **fields: str) -> tuple[str, str]:
    """Create a key through the Keys page; returns (key id, secret)."""
    tab.goto("/admin/keys")
    tab.get_by_label("Account").fill(account)
    for label, value in fields.items():
        tab.locator(f"#new-{label}").fill(value)
    tab.get_by_role("button", name="Create key").click()
    secret = tab.locator("#new-secret").inner_text()
    key_id = re.search(r"New key (key_\w+)", tab.locator("#h-secret").inner_text())[1]
    return key_id, secret


# -- access ------------------------------------------------------------------------------


def test_without_a_password_the_console_is_off_not_open(tmp_path):
    gw = start_gateway(tmp_path, {})
    try:
        for path in ("/admin/login", "/admin/keys", "/admin/fleet"):
            r = httpx.get(gw.base_url + path)
            assert r.status_code == 404 and "admin console is off" in r.text
        r = httpx.post(gw.base_url + "/admin/keys", data={"account": "x"})
        assert r.status_code == 404
    finally:
        gw.stop()


def test_pages_ask_for_a_login_and_a_wrong_password_is_refused(browser, fleet):
    gw, _ = fleet
    context = browser.new_context(base_url=gw.base_url)
    tab = context.new_page()
    tab.goto("/admin/keys")
    assert tab.url.endswith("/admin/login?next=/admin/keys")
    log_in(tab, "guess")
    assert tab.get_by_role("alert").inner_text() == "Wrong password."
    log_in(tab)
    tab.goto("/admin/login?next=/admin/keys")  # logged in: straight through
    assert tab.url.endswith("/admin/keys")
    cookie = next(c for c in context.cookies() if c["name"] == "helexa_admin")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/admin"
    context.close()


def test_the_keyboard_alone_logs_in_and_moves_around(browser, fleet):
    gw, _ = fleet
    context = browser.new_context(base_url=gw.base_url)
    tab = context.new_page()
    tab.goto("/admin/login")
    # the password field has focus from the start (autofocus lands once the page settles,
    # which on a loaded machine can be after `goto` returns)
    tab.wait_for_function("document.activeElement && document.activeElement.type === 'password'")
    tab.keyboard.type(PASSWORD)
    tab.keyboard.press("Enter")
    tab.wait_for_url("**/admin/fleet")
    tab.keyboard.press("Tab")
    assert tab.evaluate("document.activeElement.textContent") == "Skip to content"
    tab.keyboard.press("Tab")
    tab.keyboard.press("Tab")
    assert tab.evaluate("document.activeElement.getAttribute('href')") == "/admin/models"
    tab.keyboard.press("Enter")
    tab.wait_for_url("**/admin/models")
    context.close()


def test_logging_out_ends_the_session_on_the_server(browser, fleet):
    gw, _ = fleet
    context = browser.new_context(base_url=gw.base_url)
    tab = context.new_page()
    log_in(tab)
    token = next(c["value"] for c in context.cookies() if c["name"] == "helexa_admin")
    tab.get_by_role("button", name="Log out").click()
    tab.wait_for_url("**/admin/login")
    r = httpx.get(gw.base_url + "/admin/keys", cookies={"helexa_admin": token})
    assert r.status_code == 303 and r.headers["location"].startswith("/admin/login")
    context.close()


def test_a_form_posted_without_its_csrf_token_is_refused(page, fleet):
    gw, _ = fleet
    page.goto("/admin/keys")
    cookies = {c["name"]: c["value"] for c in page.context.cookies()}
    csrf = page.locator("input[name=csrf]").first.input_value()
    with httpx.Client(base_url=gw.base_url, cookies=cookies) as client:
        refused = client.post("/admin/keys", data={"account": "csrf-less"})
        assert refused.status_code == 403 and "security token" in refused.text
        wrong = client.post("/admin/keys", data={"account": "csrf-less", "csrf": "x" * 43})
        assert wrong.status_code == 403
        assert "csrf-less" not in client.get("/admin/keys").text  # nothing was created
        accepted = client.post("/admin/keys", data={"account": "with-token", "csrf": csrf})
        assert accepted.status_code == 200 and "with-token" in accepted.text


# -- keys --------------------------------------------------------------------------------


def test_a_new_keys_secret_is_shown_exactly_once_and_works(page, fleet, scripted_id):
    gw, _ = fleet
    key_id, secret = create_key(page, "acme", name="ci")
    assert secret.startswith("hx-")
    assert chat(gw, secret, scripted_id).status_code == 200
    page.reload()
    assert page.locator(f"#key-{key_id}").is_visible()
    assert secret not in page.content()
    assert page.locator("#new-secret").count() == 0


def test_a_bad_cap_re_renders_the_form_with_a_message(page):
    page.goto("/admin/keys")
    page.get_by_label("Account").fill("acme")
    page.locator("#new-tokens").fill("lots")
    page.get_by_role("button", name="Create key").click()
    assert (
        "token cap: expected a whole number, got 'lots'" in page.get_by_role("alert").inner_text()
    )
    assert page.get_by_label("Account").input_value() == "acme"  # what was typed is kept


def test_a_budget_set_in_the_console_binds_the_running_gateway(page, fleet, scripted_id):
    gw, _ = fleet
    key_id, secret = create_key(page, "capped")
    assert chat(gw, secret, scripted_id).status_code == 200
    row = page.locator(f"#key-{key_id}")
    row.get_by_text("Edit", exact=True).click()
    row.get_by_label("Token cap").fill("1")
    row.get_by_role("button", name=f"Save {key_id}").click()
    page.get_by_text(f"Saved {key_id}.").wait_for()
    assert "1 tokens (balance)" in page.locator(f"#key-{key_id}").inner_text()
    over = wait_for(lambda: chat(gw, secret, scripted_id).status_code == 429, timeout=10)
    assert over, "the new cap did not reach the gateway"
    r = chat(gw, secret, scripted_id)
    assert r.json()["error"]["code"] == "insufficient_quota"


def test_revoking_a_key_stops_it_within_seconds(page, fleet, scripted_id):
    gw, _ = fleet
    key_id, secret = create_key(page, "short-lived")
    assert chat(gw, secret, scripted_id).status_code == 200
    row = page.locator(f"#key-{key_id}")
    row.get_by_text("Revoke", exact=True).click()
    row.get_by_role("button", name=f"Revoke {key_id} for good").click()
    page.get_by_text(f"Revoked {key_id}").wait_for()
    assert "revoked" in page.locator(f"#key-{key_id}").inner_text()
    assert wait_for(lambda: chat(gw, secret, scripted_id).status_code == 401, timeout=10)


# -- models ------------------------------------------------------------------------------


def test_a_catalogue_entry_and_an_alias_added_here_are_served(page, fleet, model_dirs):
    gw, _ = fleet
    tiny2 = str(model_dirs["tiny2"])
    page.goto("/admin/models")
    page.locator("#add-id").fill(tiny2)
    page.locator("#add-cout").fill("0.25")
    page.get_by_role("button", name="Add to catalogue").click()
    page.get_by_text(f"Added {tiny2} to the catalogue.").wait_for()
    page.get_by_role("textbox", name="Alias").fill("helexa/tiny")
    page.locator("#alias-target").select_option(tiny2)
    page.get_by_role("button", name="Save alias").click()
    page.get_by_text(f"Alias helexa/tiny now points at {tiny2}.").wait_for()
    _, secret = create_key(page, "reader")
    listed = httpx.get(gw.v1 + "/models", headers={"Authorization": f"Bearer {secret}"}).json()
    models = {m["id"]: m for m in listed["data"]}
    prices = {"input": 0.0, "output": 0.25, "cache_read": 0.0, "cache_write": 0.0}
    assert models[tiny2]["cost"] == prices  # the cache's prices at the input price
    assert models["helexa/tiny"]["alias_of"] == tiny2


def test_a_model_loads_on_the_chosen_node_with_its_status_shown_then_unloads(
    page, fleet, model_dirs
):
    _, node = fleet
    tiny2 = str(model_dirs["tiny2"])
    page.goto("/admin/models")
    page.locator("#load-model").select_option(tiny2)
    page.locator("#load-node").select_option("n1")
    page.get_by_role("button", name="Load", exact=True).click()
    page.get_by_text(re.compile(r"Load(ing|ed)")).first.wait_for()
    page.locator("#placement .job.done").get_by_text("Loaded").wait_for(timeout=60_000)
    assert any(m["id"] == tiny2 for m in node.get("/models").json())
    placement = page.locator("#placement")
    placement.get_by_role("button", name=f"unload {tiny2} from n1").click()
    page.locator("#placement .job.done").get_by_text("Unloaded").wait_for()
    assert all(m["id"] != tiny2 for m in node.get("/models").json())


def test_a_script_in_a_catalogue_id_renders_as_text(page):
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto("/admin/models")
    page.locator("#add-id").fill(XSS_ID)
    page.get_by_role("button", name="Add to catalogue").click()
    page.get_by_text(f"Added {XSS_ID} to the catalogue.").wait_for()
    page.reload()
    assert page.get_by_role("cell", name=XSS_ID).first.is_visible()
    page.goto("/admin/keys")  # the id is also a model choice there
    assert page.get_by_text(XSS_ID).first.is_visible()
    assert dialogs == []


def test_a_bad_catalogue_form_answers_with_its_message_not_an_error_page(page):
    page.goto("/admin/models")
    page.locator("#add-id").fill("org/m")
    page.locator("#add-tp").fill("0")
    page.get_by_role("button", name="Add to catalogue").click()
    assert "tensor_parallel: must be at least 1" in page.get_by_role("alert").inner_text()
    assert page.locator("#add-id").input_value() == "org/m"


def test_a_models_speculative_decoding_is_chosen_shown_and_edited_here(page):
    page.goto("/admin/models")
    page.locator("#add-id").fill("org/spec")
    page.locator("#add-spec").select_option("ngram")
    page.locator("#add-nspec").fill("3")
    page.get_by_role("button", name="Add to catalogue").click()
    page.get_by_text("Added org/spec to the catalogue.").wait_for()
    row = page.get_by_role("row").filter(has=page.get_by_role("cell", name="org/spec", exact=True))
    assert "speculative ngram ×3" in row.inner_text()
    row.get_by_text("Edit").click()
    assert row.locator("select[name=speculative_method]").input_value() == "ngram"
    assert row.locator("input[name=num_speculative_tokens]").input_value() == "3"
    row.locator("select[name=speculative_method]").select_option("draft_model")
    row.get_by_role("button", name="Save").click()
    alert = page.get_by_role("alert").inner_text()
    assert "speculative_model: required with speculative_method 'draft_model'" in alert
    row = page.get_by_role("row").filter(has=page.get_by_role("cell", name="org/spec", exact=True))
    row.get_by_text("Edit").click()
    row.locator("select[name=speculative_method]").select_option("draft_model")
    row.locator("input[name=speculative_model]").fill("org/draft")
    row.locator("input[name=num_speculative_tokens]").fill("")
    row.get_by_role("button", name="Save").click()
    page.get_by_text("Saved org/spec.").wait_for()
    page.reload()
    row = page.get_by_role("row").filter(has=page.get_by_role("cell", name="org/spec", exact=True))
    assert "speculative draft_model org/draft" in row.inner_text()
    assert "×" not in row.inner_text()
    # the hub revision its cold loads fetch, then its KV settings on the node: each set
    # through an edit, shown in its row, and kept for the next edit
    for fields, shown in (
        ({"input[name=revision]": "v2.1"}, "revision v2.1"),
        ({"select[name=kv_cache_dtype]": "float16", "input[name=max_model_len]": "4096"},
         "KV float16 context 4096"),
    ):  # fmt: skip
        row.get_by_text("Edit").click()
        for selector, value in fields.items():
            field = row.locator(selector)
            field.select_option(value) if selector.startswith("select") else field.fill(value)
        row.get_by_role("button", name="Save").click()
        row = page.get_by_role("row").filter(
            has=page.get_by_role("cell", name="org/spec", exact=True)
        )
        # the page's "Saved" line may be the last save's: the row itself says this one landed
        row.get_by_role("cell").filter(has_text=shown).wait_for()
    row.get_by_text("Edit").click()
    assert row.locator("input[name=revision]").input_value() == "v2.1"


# -- fleet and spend ---------------------------------------------------------------------


def test_the_fleet_shows_the_node_and_refreshes_in_place(page, scripted_id):
    page.goto("/admin/fleet")
    card = page.locator("article.node")
    assert "n1" in card.locator("h2").inner_text() and "up" in card.locator("h2").inner_text()
    assert card.get_by_role("cell", name=scripted_id).is_visible()
    assert "MiB" in card.inner_text() or "GiB" in card.inner_text()
    with page.expect_response(lambda r: r.url.endswith("/admin/fleet/nodes"), timeout=6_000):
        pass
    assert page.url.endswith("/admin/fleet")  # swapped in place, not navigated


def test_the_ledger_filters_by_key_and_model(page, fleet, scripted_id):
    gw, _ = fleet
    key_id, secret = create_key(page, "ledgered")
    for _ in range(3):
        assert chat(gw, secret, scripted_id).status_code == 200
    page.goto("/admin/spend")
    page.locator("#f-key").select_option(key_id)
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(rf"key={key_id}"))
    rows = wait_for(lambda: _ledger_rows(page, key_id), timeout=10)
    assert len(rows) == 3 and all(key_id in r for r in rows)
    total = page.locator("#spend-total").inner_text()
    assert "3 requests" in total and re.search(r"prompt \(\d+ cached\)", total)
    headers = page.locator("table.ledger thead th").all_inner_texts()
    assert headers[5:7] == ["Prompt", "Cached"]
    assert page.locator(".chart rect.bar").count() > 0
    page.locator("#f-model").select_option(scripted_id)
    page.locator("#f-since").fill("1h")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(r"since=1h"))
    assert len(page.locator("table.ledger tbody tr").all()) == 3
    page.locator("#f-since").fill("tomorrow")
    page.get_by_role("button", name="Filter").click()
    assert "since: 'tomorrow' is neither a date" in page.get_by_role("alert").inner_text()


def _ledger_rows(page, key_id: str) -> list[str]:
    page.reload()
    rows = [r.inner_text() for r in page.locator("table.ledger tbody tr").all()]
    return rows if len(rows) == 3 and all(key_id in r for r in rows) else []


def bench(gw, tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """`helexa bench …` on the gateway's database, as an operator runs it."""
    config = tmp_path / "bench.toml"
    config.write_text(f"[gateway]\ndatabase_url = {json.dumps(gw.database_url)}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELEXA_")}
    cmd = [sys.executable, "-m", "helexa.cli", "bench", *argv, "--config", str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_bench_runs_against_the_node_skip_what_they_have_and_the_console_charts_them(
    page, fleet, scripted_id, tmp_path
):
    gw, node = fleet
    build = node.get("/version").json()
    label = build["git_sha"][:12] + ("+dirty" if build["git_dirty"] else "")
    argv = ["run", "--target", node.v1, "--target-name", "n1", "--model", scripted_id]
    argv += ["--quick", "--scenario", "chat-128,throughput-c4"]
    first = bench(gw, tmp_path, *argv)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"at build {label}" in first.stdout
    assert f"chat-128-quick · {scripted_id}: TTFT ms" in first.stdout
    assert f"(1 of 1 samples at {label})" in first.stdout
    second = bench(gw, tmp_path, *argv)
    assert second.returncode == 0, second.stdout + second.stderr
    for scenario in ("chat-128-quick", "throughput-c4-quick"):
        assert (
            f"skip {scenario} · {scripted_id}: 1 of 1 samples at {label} already" in second.stdout
        )
    assert "nothing to do" in second.stdout
    report = bench(gw, tmp_path, "report", "--target-name", "n1")
    assert report.returncode == 0, report.stderr
    row = next(line for line in report.stdout.splitlines() if "throughput-c4-quick" in line)
    assert f"`{label}`" in row and scripted_id in row

    page.goto("/admin/bench")
    section = page.locator("section[data-scenario='throughput-c4-quick']")
    chart = section.locator("figure[data-metric='tok_s']")
    assert chart.locator("circle.point").count() == 1
    assert label in chart.locator("circle.point title").text_content()
    assert label in section.locator("table.bench-table tbody tr").inner_text()
    # a later build of the same node: its point joins the line, the table shows the change
    engine = make_engine(gw.database_url)
    try:
        sessions = session_factory(engine)
        run = bh.start_run(
            sessions,
            target="n1",
            target_url=node.v1,
            build=bh.Build("f" * 40, False),
            build_info=None,
            host="ci",
            quick=True,
        )
        bh.record_sample(
            sessions,
            run,
            target="n1",
            sha="f" * 40,
            dirty=False,
            model=scripted_id,
            scenario="throughput-c4-quick",
            concurrency=4,
            requests=4,
            prompt_tokens=128,
            completion_tokens=64,
            ttft_ms=1.0,
            tok_s=1e6,
            req_s=1.0,
            latency_ms=1.0,
            wall_s=1.0,
        )
    finally:
        engine.dispose()
    page.reload()
    assert chart.locator("circle.point").count() == 2
    assert len(chart.locator("polyline").get_attribute("points").split()) == 2
    cells = section.locator("table.bench-table tbody tr").inner_text()
    assert "ffffffffffff" in cells and label in cells and "%" in cells
    page.locator("#b-target").select_option("n1")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(r"target=n1"))
    assert page.locator("section.bench-scenario").count() == 2


@pytest.mark.parametrize(
    "path", ["/admin/fleet", "/admin/models", "/admin/keys", "/admin/spend", "/admin/bench"]
)
def test_every_page_fits_a_phone_without_sideways_scrolling(page, path):
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page.goto(path)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
    finally:
        page.set_viewport_size({"width": 1280, "height": 800})


def test_five_wrong_passwords_make_the_next_login_wait(fleet):
    """Last in the module: it leaves this client locked out for a minute."""
    gw, _ = fleet
    with httpx.Client(base_url=gw.base_url) as client:

        def attempt(password: str) -> httpx.Response:
            form = client.get("/admin/login").text
            token = re.search(r'name="csrf" value="([^"]+)"', form)[1]
            return client.post("/admin/login", data={"csrf": token, "password": password})

        assert [attempt(f"guess {i}").status_code for i in range(5)] == [401] * 5
        locked = attempt(PASSWORD)
        assert locked.status_code == 429 and "Too many wrong passwords" in locked.text
        assert "helexa_admin=" not in locked.headers.get("set-cookie", "")
