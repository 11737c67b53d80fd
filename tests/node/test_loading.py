"""What a `POST /models/load` may ask for (helexa/node/loading.py), checked without HTTP:
the body's shape first (400 naming the field), then the options a node cannot honour
(422 with kind, model_id and a suggestion), all before anything is allocated."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from helexa.config import Config
from helexa.engine import EngineArgs
from helexa.errors import HelexaError
from helexa.node.loading import LoadError, LoadOptions, engine_args, parse_load_options

# whether the engine takes a draft model yet (another change adds the argument)
ENGINE_TAKES_DRAFT = "speculative_model" in {f.name for f in fields(EngineArgs)}


def refusal(body: object) -> HelexaError:
    with pytest.raises(HelexaError) as err:
        parse_load_options(body)
    assert err.value.status == 400
    return err.value


def test_a_whole_body_becomes_load_options():
    body = {
        "model_id": "org/name",
        "quant": "Q4_K_M",
        "dtype": "float16",
        "devices": [0],
        "tensor_parallel": 1,
        "revision": "main",
    }
    assert parse_load_options(body) == LoadOptions("org/name", "Q4_K_M", "float16", (0,), 1, "main")
    assert parse_load_options({"model_id": "org/name"}) == LoadOptions("org/name")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ([], "body", "expected a JSON object with model_id"),
        ({}, "model_id", "model_id: required"),
        ({"model_id": 7}, "model_id", "model_id: expected a string, got 7"),
        ({"model_id": "a/b", "quant": True}, "quant", "quant: expected a string, got true"),
        ({"model_id": "a/b", "devices": [0, -1]}, "devices", "non-negative integers"),
        ({"model_id": "a/b", "devices": [True]}, "devices", "non-negative integers"),
        ({"model_id": "a/b", "devices": "0"}, "devices", "an array of device indices"),
        ({"model_id": "a/b", "tensor_parallel": 0}, "tensor_parallel", "must be >= 1"),
        ({"model_id": "a/b", "speculative_method": 1}, "speculative_method", "a string"),
        ({"model_id": "a/b", "speculative_model": ["x"]}, "speculative_model", "a string"),
        ({"model_id": "a/b", "num_speculative_tokens": "3"}, "num_speculative_tokens", "integer"),
        ({"model_id": "a/b", "num_speculative_tokens": True}, "num_speculative_tokens", "integer"),
    ],
)
def test_a_malformed_body_is_a_400_naming_its_field(body, param, says):
    err = refusal(body)
    assert err.param == param and says in err.message


@pytest.mark.parametrize(
    ("options", "kind", "suggestion"),
    [
        (LoadOptions("a/b", quant="Q4_K_X"), "invalid_quant", "did you mean 'Q4_K_S'?"),
        (LoadOptions("a/b", dtype="float61"), "invalid_dtype", "did you mean 'float16'?"),
        (LoadOptions("a/b", devices=(99,)), "device_unavailable", None),
    ],
)
def test_an_option_the_node_cannot_honour_is_a_422_before_any_allocation(options, kind, suggestion):
    with pytest.raises(LoadError) as err:
        engine_args(Config(), options)
    e = err.value.to_envelope()["error"]
    assert err.value.status == 422
    assert (e["kind"], e["model_id"], e["code"]) == (kind, "a/b", kind)
    if suggestion is not None:
        assert e["suggestion"] == suggestion


def test_a_gguf_quant_is_named_canonically_and_an_in_situ_one_passes_through():
    assert engine_args(Config(), LoadOptions("a/b-GGUF", quant="q4-k-m")).gguf_quant == "Q4_K_M"
    assert engine_args(Config(), LoadOptions("a/b", quant="INT8")).quant == "int8"


def test_speculative_options_become_engine_args_over_the_nodes_own():
    body = {"model_id": "a/b", "speculative_method": "ngram", "num_speculative_tokens": 3}
    args = engine_args(Config(), parse_load_options(body))
    assert (args.speculative_method, args.num_speculative_tokens) == ("ngram", 3)
    cfg = Config()
    cfg.engine.speculative_method = "ngram"
    assert engine_args(cfg, LoadOptions("a/b", speculative_method="off")).speculative_method is None
    kept = engine_args(cfg, LoadOptions("a/b"))  # absent: the node's [engine]
    assert (kept.speculative_method, kept.num_speculative_tokens) == ("ngram", 4)


@pytest.mark.parametrize(
    ("options", "param", "says"),
    [
        (dict(speculative_method="eagle"), "speculative_method", "unknown speculative_method"),
        (
            dict(speculative_method="ngram", num_speculative_tokens=0),
            "num_speculative_tokens",
            "1..",
        ),
        (dict(num_speculative_tokens=17), "num_speculative_tokens", "outside 1..16"),
        (dict(speculative_method="ngram", speculative_model="o/d"), "speculative_model", "only"),
        (dict(speculative_model="o/d"), "speculative_model", "only for speculative_method"),
        (dict(speculative_method="draft_model"), "speculative_model", "needs speculative_model"),
    ],
)
def test_speculative_options_that_cannot_be_are_a_422_naming_the_field(options, param, says):
    with pytest.raises(LoadError) as err:
        engine_args(Config(), LoadOptions("a/b", **options))
    e = err.value.to_envelope()["error"]
    assert err.value.status == 422
    assert (e["kind"], e["param"], e["model_id"]) == ("invalid_speculative", param, "a/b")
    assert says in e["message"]


def test_a_misspelt_speculative_method_is_told_the_nearest():
    with pytest.raises(LoadError) as err:
        engine_args(Config(), LoadOptions("a/b", speculative_method="n-gram"))
    assert err.value.extra["suggestion"] == "did you mean 'ngram'?"


@pytest.mark.skipif(ENGINE_TAKES_DRAFT, reason="the engine takes a draft model now")
def test_a_draft_model_is_a_422_while_the_engine_cannot_load_one():
    options = LoadOptions("a/b", speculative_method="draft_model", speculative_model="o/d")
    with pytest.raises(LoadError) as err:
        engine_args(Config(), options)
    assert (err.value.status, err.value.param) == (422, "speculative_method")
    assert "no draft-model speculative decoding" in err.value.message


@pytest.mark.skipif(not ENGINE_TAKES_DRAFT, reason="the engine takes no draft model yet")
def test_a_draft_model_reaches_the_engine_as_its_checked_reference():
    options = LoadOptions(
        "a/b", speculative_method="draft_model", speculative_model="o/d", draft_ref="hf:o/d"
    )
    args = engine_args(Config(), options)
    assert (args.speculative_method, args.speculative_model) == ("draft_model", "hf:o/d")
    cfg = Config()  # a node drafting with its own draft model
    cfg.engine.speculative_method, cfg.engine.speculative_model = "draft_model", "o/e"
    args = engine_args(cfg, LoadOptions("a/b", speculative_method="ngram"))
    assert (args.speculative_method, args.speculative_model) == ("ngram", None)
    assert engine_args(cfg, LoadOptions("a/b")).speculative_model == "o/e"


def _cpu_node() -> Config:
    """A node's config with `[engine] device = "cpu"`: the same on a host with CUDA."""
    cfg = Config()
    cfg.engine.device = "cpu"
    return cfg


def test_a_cpu_node_runs_tensor_parallel_n_as_n_ranks_on_the_cpu():
    args = engine_args(_cpu_node(), LoadOptions("a/b", tensor_parallel=3))
    assert args.tensor_parallel == 3 and args.devices is None


def test_a_gguf_passes_placement_for_tensor_parallel_its_blocks_are_checked_at_load():
    for options in (
        LoadOptions("a/b-GGUF", tensor_parallel=2, quant="Q4_K_M"),
        LoadOptions("a/b", tensor_parallel=2, ref="/m/x.gguf"),
    ):
        assert engine_args(_cpu_node(), options).tensor_parallel == 2


def test_more_ranks_than_gpus_or_too_few_devices_is_a_422(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    cfg = Config()
    args = engine_args(cfg, LoadOptions("a/b", tensor_parallel=2, devices=(1, 0)))
    assert (args.devices, args.device) == ([1, 0], "cuda:1")
    for options, words in [
        (LoadOptions("a/b", tensor_parallel=4), "needs 4 GPUs; this node has 2"),
        (LoadOptions("a/b", tensor_parallel=2, devices=(1,)), "needs 2 distinct devices"),
        (LoadOptions("a/b", tensor_parallel=2, devices=(1, 1)), "needs 2 distinct devices"),
    ]:
        with pytest.raises(LoadError) as err:
            engine_args(cfg, options)
        assert err.value.code == "invalid_placement" and words in err.value.message


def test_heads_that_cannot_be_split_are_a_422_before_the_worker_starts(tmp_path):
    cfg = {"num_attention_heads": 14, "num_key_value_heads": 2, "linear_num_value_heads": 6}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": cfg}))
    ok = engine_args(_cpu_node(), LoadOptions("m", tensor_parallel=2, ref=str(tmp_path)))
    assert ok.tensor_parallel == 2
    with pytest.raises(LoadError) as err:
        engine_args(_cpu_node(), LoadOptions("m", tensor_parallel=4, ref=str(tmp_path)))
    message = err.value.message
    assert "14 attention heads do not divide across 4 ranks" in message
    assert "linear-attention value heads" in message
    # 2 KV heads across 4 ranks: replicated, so not a problem of its own
    assert "KV heads" not in message
    with pytest.raises(LoadError) as err:
        engine_args(Config(), LoadOptions("m", tensor_parallel=3, ref=str(tmp_path)))
    assert "2 KV heads can be neither split nor replicated across 3 ranks" in err.value.message
