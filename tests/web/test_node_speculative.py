"""Speculative decoding on a real node (`[engine] speculative_method = "ngram"`): the answer
is the one the engine gives without it, and /metrics and /models show how drafts fared."""

from __future__ import annotations

import random
import signal

import pytest

from helexa.engine import LLM, SamplingParams
from tests.shared_fixtures import needs_shared
from tests.web.node_proc import start_node, tiny_model

pytestmark = needs_shared


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


def test_a_load_chooses_speculation_for_its_model(spec_node, tmp_path):
    node, _ = spec_node
    other = str(tiny_model(tmp_path, "qwen3"))
    r = node.post("/models/load", {"model_id": other, "speculative_method": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative_method", r.text
    r = node.post("/models/load", {"model_id": other, "speculative_method": "off"})
    assert r.status_code == 200, r.text
    entry = next(m for m in node.get("/models").json() if m["id"] == other)
    assert entry["speculative"] is None  # off for this model, on for the node's others
