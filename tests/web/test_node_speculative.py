"""Speculative decoding on a real node (`[engine] speculative_method = "ngram"`): the answer
is the one the engine gives without it, and /metrics and /models show how drafts fared; a
load's body chooses it for its model (`POST /models/load`), over the node's setting."""

from __future__ import annotations

import random
import signal
from dataclasses import fields

import pytest

from helexa.engine import LLM, EngineArgs, SamplingParams
from tests.shared_fixtures import needs_shared
from tests.web.node_proc import start_node, tiny_model

pytestmark = needs_shared
# whether the engine takes a draft model yet (another change adds the argument)
ENGINE_TAKES_DRAFT = "speculative_model" in {f.name for f in fields(EngineArgs)}


@pytest.fixture(scope="module")
def spec_node(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-node")
    model = tiny_model(root)
    node = start_node(root / "node", [model], engine={"speculative_method": "ngram"})
    yield node, str(model)
    node.stop(signal.SIGTERM)


def test_the_answer_is_unchanged_and_the_drafts_are_counted(spec_node):
    node, model = spec_node
    rng = random.Random(0)
    unit = [rng.randrange(3, 512) for _ in range(7)]
    prompt = (unit * 8)[:50]
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    r = node.post("/v1/completions", {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    with LLM(model, dtype="float32") as plain:
        expected = plain.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        )
    assert r.json()["choices"][0]["text"] == expected[0].text
    metrics = node.get("/metrics").text
    drafted = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("helexa_spec_decode_num_draft_tokens_total{")
    )
    assert drafted > 0
    entry = next(m for m in node.get("/models").json() if m["id"] == model)
    assert entry["speculative"]["method"] == "ngram" and entry["speculative"]["drafts"] > 0
    assert entry["speculative"]["model"] is None and entry["speculative"]["rollbacks"] == 0
    assert "helexa_spec_decode_num_rollbacks_total{" in metrics  # hybrids' (0 here)


def test_a_load_chooses_speculation_for_its_model(spec_node, tmp_path):
    node, _ = spec_node
    other = str(tiny_model(tmp_path, "qwen3"))
    r = node.post("/models/load", {"model_id": other, "speculative_method": "sometimes"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "speculative_method", r.text
    r = node.post("/models/load", {"model_id": other, "speculative_method": "off"})
    assert r.status_code == 200, r.text
    entry = next(m for m in node.get("/models").json() if m["id"] == other)
    assert entry["speculative"] is None  # off for this model, on for the node's others


@pytest.fixture(scope="module")
def plain_node(tmp_path_factory):
    """A node whose [engine] leaves speculative decoding off."""
    root = tmp_path_factory.mktemp("plain-node")
    node = start_node(root / "node", [tiny_model(root)])
    yield node, root
    node.stop(signal.SIGTERM)


def _counter(metrics: str, name: str, model: str) -> float:
    label = f'{name}{{model="{model}"}}'
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(label))


def test_a_load_turns_ngram_speculation_on_for_its_model_alone(plain_node):
    node, root = plain_node
    other = str(tiny_model(root / "other", "qwen3"))
    body = {"model_id": other, "speculative_method": "ngram", "num_speculative_tokens": 3}
    r = node.post("/models/load", body)
    assert r.status_code == 200, r.text
    models = {m["id"]: m for m in node.get("/models").json()}
    assert models[other]["speculative"]["method"] == "ngram"
    assert [m["speculative"] for k, m in models.items() if k != other] == [None]
    rng = random.Random(1)
    unit = [rng.randrange(3, 512) for _ in range(5)]
    prompt = {"model": other, "prompt": (unit * 10)[:48], "max_tokens": 24, "temperature": 0}
    r = node.post("/v1/completions", {**prompt, "ignore_eos": True})
    assert r.status_code == 200, r.text
    metrics = node.get("/metrics").text
    drafts = _counter(metrics, "helexa_spec_decode_num_drafts_total", other)
    drafted = _counter(metrics, "helexa_spec_decode_num_draft_tokens_total", other)
    assert 0 < drafted <= 3 * drafts  # no draft longer than the load's 3 tokens


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"speculative_method": "sometimes"}, 422, "speculative_method"),
        (
            {"speculative_method": "ngram", "num_speculative_tokens": 0},
            422,
            "num_speculative_tokens",
        ),
        ({"num_speculative_tokens": 17}, 422, "num_speculative_tokens"),
        ({"num_speculative_tokens": "3"}, 400, "num_speculative_tokens"),
        (
            {"speculative_method": "ngram", "speculative_model": "org/draft"},
            422,
            "speculative_model",
        ),
        ({"speculative_method": "draft_model"}, 422, "speculative_model"),
        # a draft model is loaded too: only what model_id could name
        (
            {"speculative_method": "draft_model", "speculative_model": "/etc"},
            403,
            "speculative_model",
        ),
    ],
)
def test_speculative_options_that_cannot_be_are_refused_naming_the_field(
    plain_node, body, status, param
):
    node, root = plain_node
    model_id = str(root / "never-loaded")
    r = node.post("/models/load", {"model_id": model_id, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    if status == 422:
        assert (error["kind"], error["model_id"]) == ("invalid_speculative", model_id)
    assert all(m["id"] != model_id for m in node.get("/models").json())


@pytest.mark.skipif(ENGINE_TAKES_DRAFT, reason="the engine takes a draft model now")
def test_a_draft_model_load_is_a_clear_422_while_the_engine_has_none(plain_node):
    node, root = plain_node
    body = {
        "model_id": str(root / "never-loaded"),
        "speculative_method": "draft_model",
        "speculative_model": str(tiny_model(root / "draft")),
    }
    r = node.post("/models/load", body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "speculative_method"
    assert "no draft-model speculative decoding" in r.json()["error"]["message"]
    assert node.get("/health").status_code == 200  # refused, never crashed


@pytest.mark.skipif(not ENGINE_TAKES_DRAFT, reason="the engine takes no draft model yet")
def test_a_load_drafts_with_the_draft_model_it_names(plain_node):
    node, root = plain_node
    target = str(tiny_model(root / "target"))
    draft = str(tiny_model(root / "draft-model", num_hidden_layers=1))
    body = {"model_id": target, "speculative_method": "draft_model", "speculative_model": draft}
    r = node.post("/models/load", body)
    assert r.status_code == 200, r.text
    entry = next(m for m in node.get("/models").json() if m["id"] == target)
    assert entry["speculative"]["method"] == "draft_model"
    assert entry["speculative"]["model"] == draft  # which draft model drafts
    prompt = {"model": target, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}
    assert node.post("/v1/completions", prompt).status_code == 200
