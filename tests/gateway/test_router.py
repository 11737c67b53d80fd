"""The router's decisions on a fleet picture built by hand (no HTTP in them)."""

from __future__ import annotations

import asyncio

import pytest

from helexa.config import Config, ModelEntry
from helexa.errors import HelexaError
from helexa.gateway.fleet import Fleet, NodeView, with_reachable_host
from helexa.gateway.router import Router


class Calls:
    """Records the load/unload calls the router makes; answers as told."""

    def __init__(self, answers: list[tuple[int, dict]] | None = None) -> None:
        self.answers = list(answers or [])
        self.loads: list[tuple[str, str]] = []
        self.unloads: list[tuple[str, str]] = []

    async def load(self, node: NodeView, body: dict):
        self.loads.append((node.name, body["model_id"]))
        status, answer = self.answers.pop(0) if self.answers else (200, {})
        if status == 200:
            node.models[body["model_id"]] = {"id": body["model_id"], "status": "loaded"}
        return status, answer

    async def unload(self, node: NodeView, model_id: str) -> int:
        self.unloads.append((node.name, model_id))
        node.models.pop(model_id, None)
        return 200

    async def refresh(self, node: NodeView) -> None:
        return None


def fleet_with(**nodes: dict[str, str]) -> Fleet:
    fleet = Fleet([(name, f"http://{name}:13131") for name in nodes])
    for name, models in nodes.items():
        node = fleet.nodes[name]
        node.up = True
        node.models = {m: {"id": m, "status": s} for m, s in models.items()}
    return fleet


def router(fleet: Fleet, calls: Calls | None = None, models=(), aliases=None) -> Router:
    cfg = Config(models=list(models), aliases=dict(aliases or {}))
    return Router(cfg, fleet, calls or Calls())


def routes(r: Router, model: str):
    return asyncio.run(r.routes(model))


def polled(node: NodeView, in_flight: dict[str, int], sent=lambda: None) -> None:
    """A poll of `node` whose /health counts `in_flight` per model; `sent()` runs between
    the poll going out and its answer."""
    node.poll_started()
    sent()
    health = {"models": [{"id": m, "in_flight": n, "queue_depth": 0} for m, n in in_flight.items()]}
    node.mark_up(list(node.models.values()), health)


def test_the_least_busy_replica_comes_first_and_ties_go_by_name():
    fleet = fleet_with(b={"m": "loaded"}, a={"m": "loaded"}, c={"m": "loaded"})
    r = router(fleet)
    assert [x.node.name for x in routes(r, "m")] == ["a", "b", "c"]
    polled(fleet.nodes["a"], {"m": 3})
    polled(fleet.nodes["b"], {"m": 1})
    assert [x.node.name for x in routes(r, "m")] == ["c", "b", "a"]


def test_a_request_of_ours_that_a_poll_caught_is_not_counted_again_once_it_ends():
    fleet = fleet_with(a={"m": "loaded"}, b={"m": "loaded"})
    r = router(fleet)
    polled(fleet.nodes["a"], {"m": 1})  # someone else's request, straight to node a
    ours = routes(r, "m")[0]
    assert ours.node.name == "b"
    r.begin(ours)
    polled(fleet.nodes["b"], {"m": 1})  # the poll sees our request on b
    assert fleet.nodes["b"].load == {"m": 1} and fleet.nodes["b"].others_load == {"m": 0}
    r.end(ours)
    # b is idle now; until the next poll it read as busy as a, and the tie went to a
    assert [x.node.name for x in routes(r, "m")] == ["b", "a"]
    # a request of ours that starts while a poll is out is taken off that poll's count
    late = routes(r, "m")[0]
    polled(fleet.nodes["b"], {"m": 1}, sent=lambda: r.begin(late))
    r.end(late)
    assert fleet.nodes["b"].others_load == {"m": 0}
    assert routes(r, "m")[0].node.name == "b"


def test_requests_this_gateway_is_proxying_count_as_load():
    fleet = fleet_with(a={"m": "loaded"}, b={"m": "loaded"})
    r = router(fleet)
    first = routes(r, "m")[0]
    r.begin(first)
    assert routes(r, "m")[0].node.name == "b"
    r.end(first)
    assert routes(r, "m")[0].node.name == "a"


def test_an_alias_routes_to_its_model():
    r = router(fleet_with(a={"real": "loaded"}), aliases={"nick": "real"})
    (route,) = routes(r, "nick")
    assert route.model_id == "real"


def test_a_recovering_model_is_a_503_with_retry_after_2_and_no_load():
    calls = Calls()
    r = router(fleet_with(a={"m": "recovering"}), calls, models=[ModelEntry(id="m")])
    with pytest.raises(HelexaError) as e:
        routes(r, "m")
    assert (e.value.status, e.value.retry_after, e.value.code) == (503, 2.0, "model_recovering")
    assert calls.loads == []


def test_unknown_models_are_404_and_no_healthy_node_is_503_retry_after_5():
    fleet = fleet_with(a={})
    with pytest.raises(HelexaError) as e:
        routes(router(fleet), "nope")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    fleet.nodes["a"].up = False
    with pytest.raises(HelexaError) as e:
        routes(router(fleet), "nope")
    assert e.value.status == 503 and e.value.retry_after == 5.0


def test_a_cold_model_loads_on_its_pinned_node_once_for_many_requests():
    calls = Calls()
    fleet = fleet_with(a={}, b={})
    r = router(fleet, calls, models=[ModelEntry(id="m", pinned_on=["b"])])

    async def many():
        return await asyncio.gather(*(r.routes("m") for _ in range(10)))

    results = asyncio.run(many())
    assert {x[0].node.name for x in results} == {"b"}
    assert calls.loads == [("b", "m")]


def test_a_cold_load_asks_for_the_catalogues_speculative_decoding_only_when_set():
    spec = ModelEntry(id="s", speculative_method="ngram", num_speculative_tokens=3)
    draft = ModelEntry(id="d", speculative_method="draft_model", speculative_model="o/small")
    r = router(fleet_with(a={}), models=[spec, draft, ModelEntry(id="plain", quant="int8")])
    assert r.load_body("s") == {
        "model_id": "s",
        "tensor_parallel": 1,
        "speculative_method": "ngram",
        "num_speculative_tokens": 3,
    }
    assert r.load_body("d") == {
        "model_id": "d",
        "tensor_parallel": 1,
        "speculative_method": "draft_model",
        "speculative_model": "o/small",
    }
    plain = r.load_body("plain")  # nothing about it: the node's [engine] setting
    assert plain == {"model_id": "plain", "quant": "int8", "tensor_parallel": 1}


def test_memory_short_evicts_the_least_recently_used_unpinned_idle_model():
    calls = Calls([(503, {"error": {"code": "insufficient_vram"}})] * 2 + [(200, {})])
    fleet = fleet_with(
        a={"pinned": "loaded", "old": "loaded", "recent": "loaded", "busy": "loaded"}
    )
    fleet.nodes["a"].load = {"busy": 1}
    entries = [ModelEntry(id="pinned", pinned_on=["a"]), ModelEntry(id="new")]
    r = router(fleet, calls, models=entries)
    r.last_used[("a", "old")] = 1.0
    r.last_used[("a", "recent")] = 2.0
    (route,) = routes(r, "new")
    assert route.node.name == "a"
    assert calls.unloads == [("a", "old"), ("a", "recent")]  # never pinned, never busy


def test_a_load_that_fails_everywhere_is_a_503_naming_each_node():
    calls = Calls([(422, {"error": {"message": "unsupported model_type"}})] * 2)
    r = router(fleet_with(a={}, b={}), calls, models=[ModelEntry(id="m")])
    with pytest.raises(HelexaError) as e:
        routes(r, "m")
    assert e.value.status == 503 and "a: unsupported" in e.value.message
    assert "b: unsupported" in e.value.message


def test_cpu_nodes_are_feasible_only_without_a_vram_minimum():
    fleet = fleet_with(cpu={})
    fleet.nodes["cpu"].devices = [{"kind": "cpu", "memory_total_mb": 24000}]
    r = router(fleet)
    node = fleet.nodes["cpu"]
    assert r.feasible(ModelEntry(id="m"), node)
    assert not r.feasible(ModelEntry(id="m", min_device_vram_mb=8000), node)
    assert r.feasible(ModelEntry(id="m", tensor_parallel=2), node)  # two CPU ranks
    node.devices = [{"kind": "cuda", "memory_total_mb": 24000}] * 2
    assert r.feasible(ModelEntry(id="m", tensor_parallel=2, min_device_vram_mb=20000), node)
    assert not r.feasible(ModelEntry(id="m", min_device_vram_mb=30000), node)


def test_a_loopback_endpoint_gets_the_host_the_gateway_reaches_the_node_at():
    reach = "http://beast.internal:13131"
    assert with_reachable_host("http://127.0.0.1:13131", reach) == "http://beast.internal:13131"
    assert with_reachable_host("http://0.0.0.0:9000/", reach) == "http://beast.internal:9000"
    assert with_reachable_host("http://gpu7:13131", reach) == "http://gpu7:13131"
