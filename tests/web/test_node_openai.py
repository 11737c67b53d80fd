"""The node's OpenAI API, driven by the official `openai` SDK against a real node process."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.web.conftest import SCRIPT

NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def client(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.v1, api_key="unused", max_retries=0)


def _user(text: str = "Hi") -> list[dict]:
    return [{"role": "user", "content": text}]


# -- chat ---------------------------------------------------------------------------------


def test_a_chat_completion_returns_the_whole_answer_with_usage(client, scripted_id):
    r = client.chat.completions.create(model=scripted_id, messages=_user())
    assert r.object == "chat.completion"
    assert r.model == scripted_id
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == SCRIPT
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens >= len(SCRIPT.split())
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_streamed_chat_starts_with_the_role_and_ends_with_finish_reason_and_usage(
    client, scripted_id
):
    chunks = list(
        client.chat.completions.create(
            model=scripted_id,
            messages=_user(),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == SCRIPT
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    assert finish[0].usage is not None  # usage rides on the finish chunk always
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == finish[0].usage.completion_tokens


def test_without_include_usage_there_is_no_trailing_usage_chunk_but_the_finish_chunk_has_it(
    node, scripted_id
):
    body = {"model": scripted_id, "messages": _user(), "stream": True}
    with httpx.stream("POST", node.v1 + "/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["total_tokens"] > 0


def test_a_stop_string_ends_the_answer_before_it(client, scripted_id):
    r = client.chat.completions.create(model=scripted_id, messages=_user(), stop=["answer"])
    assert r.choices[0].message.content == "Hello world. The "
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=scripted_id, messages=_user(), stop="answer", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Hello world. The "


def test_max_tokens_cuts_the_answer_with_finish_reason_length(client, scripted_id):
    r = client.chat.completions.create(model=scripted_id, messages=_user(), max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    r2 = client.chat.completions.create(
        model=scripted_id, messages=_user(), max_completion_tokens=2
    )
    assert r2.usage.completion_tokens == 2


def test_a_max_tokens_beyond_the_context_is_clamped_not_refused(client, tiny_id):
    r = client.chat.completions.create(
        model=tiny_id,
        messages=_user(),
        max_tokens=32000,  # what Claude Code sends whatever the model
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 256  # the tiny model's whole context


def test_the_same_seed_gives_the_same_sample_and_another_seed_another(client, tiny_id):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=tiny_id,
            messages=_user("Tell me something"),
            temperature=1.0,
            seed=seed,
            max_tokens=24,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first


def test_chat_logprobs_list_each_token_with_its_top_alternatives(client, tiny_id):
    r = client.chat.completions.create(
        model=tiny_id,
        messages=_user(),
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())


def test_n_two_returns_two_choices_streamed_and_not(client, tiny_id):
    kw = dict(
        model=tiny_id,
        messages=_user(),
        n=2,
        temperature=1.0,
        seed=5,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16
    assert r.choices[0].message.content != r.choices[1].message.content
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}


def test_unknown_fields_from_real_clients_are_ignored(client, scripted_id):
    r = client.chat.completions.create(
        model=scripted_id,
        messages=_user(),
        extra_body={"providerOptions": {"x": 1}, "thinking": {"type": "disabled"}, "foo": [1]},
    )
    assert r.choices[0].message.content == SCRIPT


# -- completions --------------------------------------------------------------------------


def test_a_text_completion_streams_and_echoes(client, scripted_id):
    r = client.completions.create(model=scripted_id, prompt="Say it:", max_tokens=64)
    assert r.object == "text_completion"
    assert r.choices[0].text == SCRIPT
    assert r.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model=scripted_id, prompt="Say it:", echo=True)
    assert echoed.choices[0].text == "Say it:" + SCRIPT
    streamed = client.completions.create(
        model=scripted_id, prompt="Say it:", stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == SCRIPT
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completion_logprobs_come_as_parallel_arrays(client, tiny_id):
    r = client.completions.create(
        model=tiny_id, prompt=[5, 6, 7], max_tokens=4, logprobs=2, temperature=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


# -- concurrency --------------------------------------------------------------------------


def test_twenty_concurrent_streams_each_equal_their_solo_greedy_output(node, tiny_id):
    prompts = [f"Prompt number {i}: " + "word " * (i % 7) for i in range(20)]
    kw = dict(
        model=tiny_id, temperature=0, max_tokens=16, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip

    async def one(client: openai.AsyncOpenAI, prompt: str):
        tokens, logprobs = [], []
        stream = await client.chat.completions.create(messages=_user(prompt), stream=True, **kw)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                for entry in chunk.choices[0].logprobs.content:
                    tokens.append(entry.token)
                    logprobs.append([t.logprob for t in entry.top_logprobs])
        return tokens, logprobs

    async def run():
        async with openai.AsyncOpenAI(base_url=node.v1, api_key="x", max_retries=0) as client:
            solo = [await one(client, p) for p in prompts]
            together = await asyncio.gather(*(one(client, p) for p in prompts))
        return solo, together

    solo, together = asyncio.run(run())
    for i, ((a, a_lps), (b, _)) in enumerate(zip(solo, together, strict=True)):
        assert len(b) == 16
        for step, (ta, tb) in enumerate(zip(a, b, strict=True)):
            if ta != tb:
                gap = a_lps[step][0] - a_lps[step][1]
                assert gap <= NEAR_TIE, f"stream {i} diverged at {step} with gap {gap:.2e}"
                break


def test_a_client_that_disconnects_mid_stream_frees_its_sequence_and_kv(node, long_id):
    body = {
        "model": long_id,
        "messages": _user(),
        "stream": True,
        "max_tokens": 8000,
        "ignore_eos": True,
    }
    aborted_before = _metric(node, "helexa_request_success_total", long_id, "abort") or 0
    with httpx.stream("POST", node.v1 + "/chat/completions", json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:  # still reading: the sequence holds KV and a running slot
                assert _kv_usage(node, long_id) > 0
                assert _health_model(node, long_id)["in_flight"] == 1
                break  # leave mid-stream (dropping the line iterator closes the response)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _kv_usage(node, long_id) == 0 and _health_model(node, long_id)["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert _kv_usage(node, long_id) == 0
    assert _health_model(node, long_id)["in_flight"] == 0
    assert _metric(node, "helexa_request_success_total", long_id, "abort") == aborted_before + 1
    generated = _metric(node, "helexa_generation_tokens_total", long_id)
    assert generated is not None and generated < 8000


def _health_model(node, model_id: str) -> dict:
    return next(m for m in node.get("/health").json()["models"] if m["id"] == model_id)


def _metric(node, name: str, model: str, reason: str | None = None) -> float | None:
    for line in node.get("/metrics").text.splitlines():
        ours = line.startswith(name + "{") and f'model="{model}"' in line
        if ours and (reason is None or f'finished_reason="{reason}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return None


def _kv_usage(node, model: str) -> float:
    value = _metric(node, "helexa_kv_cache_usage", model)
    assert value is not None
    return value


# -- errors -------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return err


def test_malformed_json_is_a_400_envelope(node):
    r = httpx.post(node.v1 + "/chat/completions", content=b"{not json", timeout=10)
    assert _error(r, 400)["param"] == "body"


def test_a_wrongly_typed_field_is_a_400_naming_it(node, scripted_id):
    body = {"model": scripted_id, "messages": _user(), "temperature": "hot"}
    assert _error(node.post("/v1/chat/completions", body), 400)["param"] == "temperature"
    body = {"model": scripted_id, "messages": [{"role": "user", "content": 7}]}
    assert _error(node.post("/v1/chat/completions", body), 400)["param"] == "messages[0].content"


def test_an_unknown_model_is_a_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no/such-model", messages=_user())
    assert e.value.body["code"] == "model_not_found"


def test_empty_messages_are_a_400(node, scripted_id):
    err = _error(node.post("/v1/chat/completions", {"model": scripted_id, "messages": []}), 400)
    assert err["param"] == "messages"


def test_a_prompt_longer_than_the_context_is_refused_before_any_compute(node, tiny_id):
    body = {"model": tiny_id, "messages": _user("word " * 400)}
    err = _error(node.post("/v1/chat/completions", body), 400)
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in err["message"]
    streamed = node.post("/v1/chat/completions", {**body, "stream": True})
    assert _error(streamed, 400)["code"] == "context_length_exceeded"


def test_unknown_routes_and_methods_answer_with_the_envelope(node):
    _error(node.get("/v1/nothing-here"), 404)
    _error(node.get("/v1/chat/completions"), 405)


def test_a_client_that_gives_up_on_a_non_streaming_request_frees_it_too(node, long_id):
    aborted_before = _metric(node, "helexa_request_success_total", long_id, "abort") or 0
    body = {"model": long_id, "messages": _user(), "max_tokens": 8000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(node.v1 + "/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _health_model(node, long_id)["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert _health_model(node, long_id)["in_flight"] == 0
    assert _kv_usage(node, long_id) == 0
    assert _metric(node, "helexa_request_success_total", long_id, "abort") == aborted_before + 1


def test_a_gateway_budget_header_caps_prompt_plus_output_exactly(node, tiny_id):
    body = {"model": tiny_id, "messages": _user(), "max_tokens": 1000, "ignore_eos": True}

    def send(budget: str) -> httpx.Response:
        return httpx.post(
            node.v1 + "/chat/completions",
            json=body,
            headers={"x-helexa-budget": budget},
            timeout=60,
        )

    r = send("tokens=60")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 60
    assert r.json()["choices"][0]["finish_reason"] == "length"
    priced = send("cost=0.00005; in=1; out=1")  # $1 per 1M tokens: 50 tokens in all
    assert priced.json()["usage"]["total_tokens"] == 50
    refused = send("tokens=5")  # less than the prompt itself
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert "Retry-After" not in refused.headers
    bad = send("tokens=lots")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-helexa-budget"


# -- logit_bias ---------------------------------------------------------------------------


def test_logit_bias_steers_greedy_decoding_and_unknown_ids_are_refused(node, tiny_id):
    """+100 on one token makes it the argmax at every step; -100 on the unbiased answer's
    first token keeps it out of first place."""
    body = {"model": tiny_id, "prompt": "Once upon", "max_tokens": 4, "temperature": 0}
    body["logprobs"] = 0
    plain = node.post("/v1/completions", body).json()["choices"][0]
    forced = node.post("/v1/completions", {**body, "logit_bias": {"42": 100}}).json()
    tokens = forced["choices"][0]["logprobs"]["tokens"]
    one = node.post("/tokenize", {"model": tiny_id, "prompt": tokens[0]}).json()["tokens"]
    assert len(set(tokens)) == 1 and one[-1] == 42, tokens
    first = plain["logprobs"]["tokens"][0]
    first_id = node.post("/tokenize", {"model": tiny_id, "prompt": first}).json()["tokens"][-1]
    banned = node.post("/v1/completions", {**body, "logit_bias": {str(first_id): -100}}).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != first
    r = node.post("/v1/completions", {**body, "logit_bias": {"99999999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    # a stop token the model cannot produce, however large (the worker's wire holds 64 bits)
    for huge in (99999999, 1180591620717411303424):
        r = node.post("/v1/completions", {**body, "stop_token_ids": [huge]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
