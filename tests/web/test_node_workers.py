"""Each model's engine runs in a worker process: a worker that dies, segfaults or hangs is
replaced and its model reloaded, while the node process serves on (issue 17)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest

from helexa.engine.llm_engine import EngineArgs
from helexa.engine.sampling_params import SamplingParams
from helexa.engine.worker_client import AbortedOutput, WorkerClient, WorkerFaultError
from tests.web.node_proc import start_node

LONG = {"max_tokens": 4000, "ignore_eos": True, "stream": True}


def _chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **kw}


def _entry(node, model_id: str) -> dict | None:
    return next((m for m in node.get("/models").json() if m["id"] == model_id), None)


def _worker_pid(node, model_id: str) -> int:
    entry = _entry(node, model_id)
    assert entry is not None and entry["status"] == "loaded", entry
    (worker,) = entry["workers"]
    return worker["pid"]


def _statuses_until_loaded(node, model_id: str, old_pid: int, timeout: float = 90) -> list[str]:
    """Every status /models shows until the model is loaded again in a new worker."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = _entry(node, model_id)
        status = entry["status"] if entry else "absent"
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == "loaded" and entry["workers"][0]["pid"] != old_pid:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"not reloaded in {timeout}s; statuses seen: {seen}")


def _stream_until_content(client: httpx.Client, body: dict):
    """Open a stream and read it up to its first content chunk; the rest is the caller's."""
    ctx = client.stream("POST", "/v1/chat/completions", json=body)
    r = ctx.__enter__()
    assert r.status_code == 200
    lines = r.iter_lines()
    for line in lines:
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
            "content"
        ):
            return ctx, lines
    raise AssertionError("the stream ended before any content")


@pytest.fixture(scope="module")
def node(tmp_path_factory, model_dirs):
    node = start_node(
        tmp_path_factory.mktemp("workers"),
        [model_dirs["long"], model_dirs["scripted"]],
        # on the CPU wherever the tests run: its tests read CPU workers and load TP=2 (gloo)
        engine={"step_timeout_s": 3.0, "device": "cpu"},
    )
    yield node
    node.stop()


def test_models_and_health_show_each_models_worker(node, model_dirs):
    long_id = str(model_dirs["long"])
    entry = _entry(node, long_id)
    (worker,) = entry["workers"]
    assert worker["rank"] == 0 and worker["state"] == "running" and worker["device"] == "cpu"
    assert entry["tensor_parallel"] == 1 and entry["devices"] == []  # CPU: no CUDA indices
    pids = {w["pid"] for m in node.get("/models").json() for w in m["workers"]}
    assert len(pids) == 2 and node.proc.pid not in pids  # one process per model, not the node
    for pid in pids:
        assert os.getppid() != pid and os.path.exists(f"/proc/{pid}")
    health = node.get("/health").json()
    assert {m["id"]: m["workers"][0]["state"] for m in health["models"]} == {
        long_id: "running",
        str(model_dirs["scripted"]): "running",
    }


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_and_comes_back(node, model_dirs):
    long_id, other = str(model_dirs["long"]), str(model_dirs["scripted"])
    node_pid = node.proc.pid
    old_pid = _worker_pid(node, long_id)
    other_pid = _worker_pid(node, other)
    with httpx.Client(base_url=node.base_url, timeout=60) as client:
        ctx, lines = _stream_until_content(client, _chat(long_id, **LONG))
        os.kill(old_pid, signal.SIGKILL)
        rest = list(lines)
        ctx.__exit__(None, None, None)
    errors = [ln for ln in rest if ln.startswith("data: {") and '"error"' in ln]
    assert errors, rest[-5:]
    assert "model_recovering" in errors[-1] or "device fault" in errors[-1]
    # what the worker generated before it died is still told, to be billed
    assert json.loads(errors[-1][6:])["error"]["usage"]["completion_tokens"] >= 1
    assert "data: [DONE]" not in rest or rest.index("data: [DONE]") > rest.index(errors[-1])

    seen = _statuses_until_loaded(node, long_id, old_pid)
    assert "recovering" in seen, seen
    r = node.post("/v1/chat/completions", _chat(long_id, max_tokens=8))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert node.proc.poll() is None and node.proc.pid == node_pid
    assert _worker_pid(node, other) == other_pid  # the other model never noticed
    assert "poisoned" in node.log() and "SIGKILL" in node.log()


def test_a_segfaulting_idle_worker_is_replaced_before_anyone_asks(node, model_dirs):
    scripted = str(model_dirs["scripted"])
    old_pid = _worker_pid(node, scripted)
    os.kill(old_pid, signal.SIGSEGV)
    _statuses_until_loaded(node, scripted, old_pid)
    r = node.post("/v1/chat/completions", _chat(scripted))
    assert r.status_code == 200
    assert "SIGSEGV" in node.log()


def test_a_hung_worker_is_killed_after_step_timeout_and_its_requests_get_a_clean_error(
    node, model_dirs
):
    long_id = str(model_dirs["long"])
    old_pid = _worker_pid(node, long_id)
    body = _chat(long_id, max_tokens=4000, ignore_eos=True)
    with httpx.Client(base_url=node.base_url, timeout=60) as client:
        ctx, lines = _stream_until_content(client, {**body, "stream": True})
        os.kill(old_pid, signal.SIGSTOP)  # alive, silent: a hung step or collective
        t0 = time.monotonic()
        rest = list(lines)
        waited = time.monotonic() - t0
        ctx.__exit__(None, None, None)
    assert any('"error"' in ln for ln in rest), rest[-3:]
    assert 2.5 < waited < 30, waited  # step_timeout_s = 3
    # meanwhile new requests are told to come back, not queued behind a dead worker
    r = node.post("/v1/chat/completions", body | {"max_tokens": 4})
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] and r.json()["error"]["code"] == "model_recovering"
    _statuses_until_loaded(node, long_id, old_pid)
    assert not os.path.exists(f"/proc/{old_pid}") or _is_zombie(old_pid)
    assert "said nothing" in node.log()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_tensor_parallel_2_runs_two_ranks_that_recover_together_and_answer_as_one(node, model_dirs):
    """POST /models/load {"tensor_parallel": 2} on a CPU node: two rank processes (gloo).
    Killing rank 1 fails rank 0's collective: the model is reloaded, both ranks anew. Its
    greedy answer is the one-rank answer."""
    model = str(model_dirs["tiny2"])
    body = _chat(model, max_tokens=24, temperature=0, ignore_eos=True)
    r = node.post("/models/load", {"model_id": model, "tensor_parallel": 2})
    assert r.status_code == 200, r.text
    entry = _entry(node, model)
    assert entry["tensor_parallel"] == 2
    ranks = entry["workers"]
    assert [w["rank"] for w in ranks] == [0, 1] and len({w["pid"] for w in ranks}) == 2
    sharded = node.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert sharded["content"]

    os.kill(ranks[1]["pid"], signal.SIGKILL)
    r = node.post("/v1/chat/completions", body)  # rank 0 finds rank 1 gone mid-step
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_recovering", r.text
    _statuses_until_loaded(node, model, ranks[0]["pid"])
    again = _entry(node, model)["workers"]
    assert len(again) == 2 and not {w["pid"] for w in again} & {w["pid"] for w in ranks}
    assert node.post("/v1/chat/completions", body).json()["choices"][0]["message"] == sharded

    assert node.post("/models/unload", {"model_id": model}).status_code == 200
    for w in again:  # every rank went with the unload
        assert not os.path.exists(f"/proc/{w['pid']}") or _is_zombie(w["pid"])
    assert node.post("/models/load", {"model_id": model}).status_code == 200
    whole = node.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert whole == sharded
    node.post("/models/unload", {"model_id": model})


# -- an aborted request's last word: every token the engine spent, told -------------------


def _worker(model_dir, **engine) -> EngineArgs:
    return EngineArgs(
        model=str(model_dir), device="cpu", kv_cache_memory_mb=16, num_threads=1, **engine
    )


async def _read_until_aborted(client: WorkerClient, agen, request_id: str) -> list:
    client.abort(request_id)
    return [out async for out in agen]


def test_an_aborted_request_ends_with_the_engines_count_deltas_on_their_way_included(model_dirs):
    """The worker's report on an abort, with the deltas that were in flight, holds every
    token the engine generated (its own counter, as the worker last reported its stats)."""

    async def scenario() -> None:
        client = await WorkerClient.start("long", _worker(model_dirs["long"]))
        try:
            prompt = client.tokenizer.encode("Once upon a time")
            before = client.stats.num_generated_tokens
            agen = client.generate(prompt, SamplingParams(max_tokens=4000, ignore_eos=True), "a")
            seen = [await anext(agen) for _ in range(3)]
            await asyncio.sleep(0.3)  # the engine goes on; its deltas queue up unread
            rest = await _read_until_aborted(client, agen, "a")
            last = rest[-1]
            assert isinstance(last, AbortedOutput), last
            assert last.finished and last.finish_reason == "abort"
            assert last.num_computed_prompt_tokens == len(prompt)
            assert len(rest) > 2, "nothing was on its way: the test proves nothing"
            generated = client.stats.num_generated_tokens - before
            assert sum(len(o.token_ids) for o in seen + rest) == generated
            assert client.num_in_flight == 0
            # the worker serves on
            again = [o async for o in client.generate(prompt, SamplingParams(max_tokens=4))]
            assert again[-1].finish_reason == "length"
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_a_prompt_aborted_during_its_prefill_reports_the_chunks_the_engine_computed(model_dirs):
    chunk = 8

    async def scenario() -> None:
        engine = {"max_prefill_chunk": chunk, "max_num_batched_tokens": 64}
        client = await WorkerClient.start("long", _worker(model_dirs["long"], **engine))
        try:
            prompt = random.Random(7).choices(range(1000, 40000), k=6000)
            agen = client.generate(prompt, SamplingParams(max_tokens=4), "p")
            first = asyncio.ensure_future(anext(agen))
            while client.stats.num_running == 0:  # admitted: its prefill has begun
                await asyncio.sleep(0.002)
            assert not first.done()
            client.abort("p")
            last = await first
            assert isinstance(last, AbortedOutput), last
            assert last.finish_reason == "abort" and last.token_ids == []
            assert 0 < last.num_computed_prompt_tokens < len(prompt)
            assert last.num_computed_prompt_tokens % chunk == 0
            assert [o async for o in agen] == []
            assert client.stats.num_generated_tokens == 0
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_an_abort_waits_for_the_workers_report_however_long_a_step_takes(model_dirs):
    """A worker stopped for 4 s (a step on a loaded CPU) still reports on the aborted
    request when it goes on: the request ends with the engine's count, not with a guess
    made after a fixed wait (a 2 s one once lost such tokens from the books)."""

    async def scenario() -> None:
        client = await WorkerClient.start("long", _worker(model_dirs["long"]))
        pid = client.proc.pid
        try:
            prompt = client.tokenizer.encode("Once upon a time")
            agen = client.generate(prompt, SamplingParams(max_tokens=4000, ignore_eos=True), "s")
            await anext(agen)
            os.kill(pid, signal.SIGSTOP)
            resume = asyncio.get_running_loop().call_later(4.0, os.kill, pid, signal.SIGCONT)
            t0 = time.monotonic()
            seen = await _read_until_aborted(client, agen, "s")
            assert time.monotonic() - t0 > 3.9
            assert isinstance(seen[-1], AbortedOutput), seen[-1]  # the engine's own word
            assert client.state == "running" and client.num_in_flight == 0
            resume.cancel()
        finally:
            os.kill(pid, signal.SIGCONT)
            await client.shutdown()

    asyncio.run(scenario())


def test_an_abort_a_hung_worker_never_answers_ends_when_the_watchdog_faults_it(model_dirs):
    async def scenario() -> None:
        client = await WorkerClient.start("long", _worker(model_dirs["long"], step_timeout_s=3.0))
        pid = client.proc.pid
        try:
            prompt = client.tokenizer.encode("Once upon a time")
            agen = client.generate(prompt, SamplingParams(max_tokens=4000, ignore_eos=True), "h")
            await anext(agen)
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(WorkerFaultError):
                await _read_until_aborted(client, agen, "h")
            waited = time.monotonic() - t0
            # the step timeout, not before; the upper bound with room for a loaded machine
            assert 3.0 - 0.1 < waited < 60, waited
            assert client.state == "faulted" and client.num_in_flight == 0
        finally:
            os.kill(pid, signal.SIGCONT)
            await client.shutdown()

    asyncio.run(scenario())
