"""One request's path through the node (helexa/node/serving.py) without HTTP, on a real
engine serving the scripted test architecture.

Each test builds its own node and runs its own loop with `asyncio.run`; assertions are on
the answer, the admission counters and the engine's own statistics (as its worker process last reported them).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from helexa.config import Config
from helexa.errors import HelexaError
from helexa.node import serving
from helexa.node.loading import LoadOptions
from helexa.node.served import ServedModel
from helexa.node.service import Node, build_node
from helexa.protocol.openai import parse_chat_request, parse_completion_request
from helexa.protocol.wire import SSE_DONE, SpendBudget
from tests.shared_fixtures import need_shared
from tests.web.node_proc import scripted_model

SCRIPT = " ".join(["word"] * 200)  # long enough to still be generating when a test looks


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory) -> Path:
    need_shared()
    return scripted_model(tmp_path_factory.mktemp("serving"), SCRIPT)


@contextlib.asynccontextmanager
async def serving_node(model_dir: Path, **node_cfg: Any) -> AsyncIterator[tuple[Node, ServedModel]]:
    cfg = Config()
    cfg.engine.kv_cache_memory_mb = 4
    cfg.engine.num_threads = 1
    for name, value in node_cfg.items():
        setattr(cfg.node, name, value)
    node = build_node(cfg)
    served = await node.registry.load(LoadOptions("scripted", ref=str(model_dir)))
    try:
        yield node, served
    finally:
        await node.shutdown()


def completion(max_tokens: int | None = 5, *, stream: bool = False) -> Any:
    body: dict[str, Any] = {"model": "scripted", "prompt": "say words", "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_completion_request(body)


async def settle_until(condition, timeout_s: float = 10.0) -> None:
    """Let the loop and the engine thread run until `condition()` holds."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def test_a_request_runs_to_its_answer_and_releases_its_slot(scripted_dir):
    async def scenario() -> None:
        async with serving_node(scripted_dir) as (node, served):
            notes: dict[str, Any] = {}
            answer = await serving.complete(node, completion(5), principal="a/k", notes=notes)
            assert answer["choices"][0]["text"] == " ".join(["word"] * 5)
            assert answer["choices"][0]["finish_reason"] == "length"
            assert served.admission.num_running == 0
            assert served.admission.held_by("a/k") == 0
            assert notes["model"] == "scripted"
            assert notes["completion_tokens"] == 5 and notes["finish_reason"] == "length"
            assert notes["prompt_tokens"] == answer["usage"]["prompt_tokens"]

    asyncio.run(scenario())


def test_a_full_admission_refuses_before_the_prompt_is_tokenized(scripted_dir, monkeypatch):
    rendered: list[object] = []
    real = serving.prepare_prompt
    monkeypatch.setattr(serving, "prepare_prompt", lambda *a: rendered.append(a) or real(*a))

    async def scenario() -> None:
        async with serving_node(scripted_dir, max_running_requests=1, max_waiting_requests=0) as (
            node,
            served,
        ):
            held = await served.admission.acquire("someone/else")
            notes: dict[str, Any] = {}
            with pytest.raises(HelexaError) as err:
                await serving.admit(node, completion(), principal="a/k", notes=notes)
            assert err.value.status == 503
            assert rendered == [] and "prompt_tokens" not in notes
            held.release()
            await serving.complete(node, completion(), principal="a/k", notes=notes)
            assert len(rendered) == 1

    asyncio.run(scenario())


def test_a_stream_closed_early_releases_its_slot_and_aborts_its_sequence(scripted_dir):
    async def scenario() -> None:
        async with serving_node(scripted_dir) as (node, served):
            notes: dict[str, Any] = {}
            run = await serving.admit(
                node, completion(None, stream=True), principal=None, notes=notes
            )
            assert served.admission.num_running == 1
            events = aiter(run.stream())
            first = [await anext(events) for _ in range(3)]  # the opening and two words
            assert all(e.startswith(b"data: ") for e in first)
            assert served.stats.num_running == 1
            await events.aclose()  # the client left
            assert served.admission.num_running == 0
            assert notes["finish_reason"] == "abort"
            await settle_until(lambda: served.stats.num_running == 0)
            await settle_until(lambda: served.stats.kv_usage == 0)

    asyncio.run(scenario())


def test_a_stream_never_read_still_releases_its_slot(scripted_dir):
    async def scenario() -> None:
        async with serving_node(scripted_dir) as (node, served):
            run = await serving.admit(node, completion(stream=True), principal=None, notes={})
            stream = run.stream()
            assert served.admission.num_running == 1
            del run, stream
            gc.collect()
            assert served.admission.num_running == 0

    asyncio.run(scenario())


def test_a_stream_read_to_the_end_is_its_whole_answer_then_done(scripted_dir):
    async def scenario() -> None:
        async with serving_node(scripted_dir) as (node, served):
            run = await serving.admit(node, completion(3, stream=True), principal=None, notes={})
            events = [e async for e in run.stream()]
            assert served.admission.num_running == 0
            assert events[-1] == SSE_DONE
            chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == "word word word"

    asyncio.run(scenario())


def test_cancelling_a_whole_answer_releases_its_slot_and_aborts_its_sequence(scripted_dir):
    async def scenario() -> None:
        async with serving_node(scripted_dir) as (node, served):
            work = asyncio.create_task(
                serving.complete(node, completion(None), principal=None, notes={})
            )
            await settle_until(lambda: served.stats.num_running == 1)
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            assert served.admission.num_running == 0
            await settle_until(lambda: served.stats.num_running == 0)

    asyncio.run(scenario())


def test_the_gateways_budget_lowers_the_output_limit(scripted_dir):
    async def scenario() -> None:
        async with serving_node(scripted_dir) as (node, _served):
            req = parse_chat_request(
                {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
            )
            prompt_tokens = (await serving.tokenize(node, req, {}))["count"]
            budget = SpendBudget(tokens=prompt_tokens + 4)
            answer = await serving.complete(node, req, principal=None, budget=budget, notes={})
            assert req.max_tokens == 4
            assert answer["usage"]["completion_tokens"] == 4
            assert answer["choices"][0]["finish_reason"] == "length"

    asyncio.run(scenario())


def test_a_draining_node_refuses_new_requests(scripted_dir):
    async def scenario() -> None:
        async with serving_node(scripted_dir) as (node, served):
            node.draining = True
            with pytest.raises(HelexaError) as err:
                await serving.admit(node, completion(), principal=None, notes={})
            assert err.value.status == 503 and "shutting down" in err.value.message
            assert served.admission.num_running == 0

    asyncio.run(scenario())


def test_an_unknown_model_is_a_404_and_tokenize_counts_the_prompt(scripted_dir):
    async def scenario() -> None:
        async with serving_node(scripted_dir) as (node, served):
            req = parse_completion_request({"model": "nope", "prompt": "x"})
            with pytest.raises(HelexaError) as err:
                await serving.admit(node, req, principal=None, notes={})
            assert err.value.status == 404
            counted = await serving.tokenize(node, completion(), {})
            assert counted["tokens"] == served.tokenizer.encode(
                "say words", add_special_tokens=True
            )
            assert counted["count"] == len(counted["tokens"])

    asyncio.run(scenario())
