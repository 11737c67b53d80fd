"""A catalogue entry's speculative decoding reaches the node with its cold load: a real
gateway in front of a real node whose [engine] leaves speculation off."""

from __future__ import annotations

import signal

import pytest

from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import start_node


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("spec-fleet")
    tiny, tiny2 = str(model_dirs["tiny"]), str(model_dirs["tiny2"])
    node = start_node(tmp / "n1", [model_dirs["scripted"]])
    gw = start_gateway(
        tmp,
        {"n1": node},
        models=[
            {"id": tiny2, "speculative_method": "ngram", "num_speculative_tokens": 3},
            {"id": tiny},
        ],
    )
    yield gw, node, tiny2, tiny
    gw.stop()
    node.stop(signal.SIGTERM)


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def test_a_catalogue_entry_with_ngram_is_cold_loaded_with_speculation_on(fleet):
    gw, node, speculating, plain = fleet
    for model in (speculating, plain):
        r = gw.post("/v1/chat/completions", _chat(model))
        assert r.status_code == 200, r.text
    on_node = {m["id"]: m for m in node.get("/models").json()}
    assert on_node[speculating]["speculative"]["method"] == "ngram"
    assert on_node[plain]["speculative"] is None  # unset in the catalogue: the node's (off)
