"""The node's management routes answer in the SPEC shapes."""

from __future__ import annotations

import re


def test_discovery_describes_the_host_and_the_prompt_cap(node):
    d = node.get("/discovery").json()
    assert d["hostname"] and d["os"]["system"]
    assert d["cpu"]["logical_cores"] >= 1
    assert isinstance(d["devices"], list)
    assert "cuda_unavailable_reason" in d
    assert d["engines"]["helexa"] and d["engines"]["torch"]
    # the smallest input limit among loaded models: the tiny ones have 256 positions
    assert 0 < d["max_prompt_tokens"] < 256


def test_health_reports_activation_devices_and_per_model_load(node, scripted_id, tiny_id):
    h = node.get("/health").json()
    assert h["status"] == "ok"
    assert h["activation"]["state"] == "ready"
    assert set(h["activation"]["completed"]) >= {scripted_id, tiny_id}
    assert h["activation"]["failed"] == [] and h["activation"]["pending"] == []
    assert h["devices"] and "memory_total_mb" in h["devices"][0]
    models = {m["id"]: m for m in h["models"]}
    assert models[tiny_id]["in_flight"] >= 0 and models[tiny_id]["queue_depth"] >= 0


def test_models_lists_status_limits_and_memory(node, tiny_id, scripted_id):
    models = {m["id"]: m for m in node.get("/models").json()}
    tiny = models[tiny_id]
    assert tiny["status"] == "loaded"
    assert tiny["capabilities"] == ["text"]
    assert tiny["dtype"] == "float32"
    assert tiny["limit"]["context"] == 256
    assert tiny["limit"]["input"] + tiny["limit"]["output"] <= 256
    assert tiny["memory_mb"] > 0
    assert {"tool_call", "reasoning", "devices", "quant"} <= set(tiny)
    assert tiny["autotune"]["state"] == "off"  # float weights: no CPU plans to tune
    assert tiny["quant"] is None and re.fullmatch(r"float×\d+", tiny["linear_weights"])
    assert models[scripted_id]["status"] == "loaded"


def test_a_models_endpoint_is_this_node(node, tiny_id):
    r = node.get(f"/models/{tiny_id}/endpoint")
    assert r.status_code == 200
    assert r.json() == {"model_id": tiny_id, "endpoint": node.base_url}
    assert node.get("/models/not-loaded/endpoint").json()["error"]["code"] == "model_not_found"


def test_version_carries_build_and_runtime_versions(node):
    v = node.get("/version").json()
    assert v["version"]
    assert re.fullmatch(r"[0-9a-f]{40}", v["git_sha"] or "0" * 40)
    assert v["python"] and v["torch"]
    assert {"cuda", "triton", "git_dirty", "build_time"} <= set(v)


def test_v1_models_lists_loaded_models_with_their_context(node, tiny_id):
    body = node.get("/v1/models").json()
    assert body["object"] == "list"
    card = next(m for m in body["data"] if m["id"] == tiny_id)
    assert card["object"] == "model"
    assert card["max_model_len"] == 256


def test_metrics_expose_the_documented_families_labelled_by_model(node, scripted_id):
    node.post(
        "/v1/chat/completions",
        {"model": scripted_id, "messages": [{"role": "user", "content": "x"}]},
    )
    text = node.get("/metrics").text
    for name in (
        "helexa_requests_running",
        "helexa_requests_waiting",
        "helexa_time_to_first_token_seconds_bucket",
        "helexa_inter_token_latency_seconds_bucket",
        "helexa_prompt_tokens_total",
        "helexa_generation_tokens_total",
        "helexa_kv_cache_usage",
        "helexa_request_success_total",
        "helexa_prefix_cache_hits_total",
    ):
        assert re.search(rf'^{name}{{.*model="{re.escape(scripted_id)}"', text, re.M), name
    assert re.search(r'helexa_request_success_total\{finished_reason="stop"', text)
