"""Property-based fuzzing of a live node: whatever a client sends, it gets an OpenAI answer.

Bodies come in three kinds: plausible requests (valid ones, and valid ones with a few fields
swapped for edge values or junk), arbitrary JSON, and raw bytes that are not JSON at all.
Every answer must be a 200 of the right shape or an OpenAI error envelope with a 4xx/503
status, never a 500 and never a hang; afterwards the node must still be up with every
admission slot free.
"""

from __future__ import annotations

import json
import string
import time
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.web.conftest import SCRIPT

ALLOWED = {200, 400, 404, 413, 422, 429, 503}
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,  # no .hypothesis/ in the repo; failures print a reproduce blob instead
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
HUGE = [2**63, 2**64, 10**12, 10**30, 10**400]

# -- JSON values ------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 1, *HUGE, -(10**30)]),
    st.floats(),  # NaN and ±Infinity too: json.dumps writes them, Python's json reads them
    st.text(max_size=12),
)
any_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


def edge_or_junk(*edges: Any) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(edges), any_json)


NUMBER_EDGES = (-1, -0.5, 0, 1e-300, 1e308, 10**400, float("nan"), float("inf"), "0.7", True, [])
INT_EDGES = (0, -1, 17, 1.5, 2.0, "2", True, [], *HUGE, -(2**63) - 1)
PARAMS = {"type": "object", "properties": {"x": {"type": "string"}}}

# -- plausible chat / completions bodies ------------------------------------------------------

text_part = st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=20))
valid_content = st.one_of(st.text(max_size=40), st.lists(text_part, min_size=1, max_size=3))
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"name": st.text(max_size=8), "tool_call_id": st.text(max_size=8)},
).flatmap(lambda m: valid_content.map(lambda c: {**m, "content": c}))
tool_call = st.fixed_dictionaries(
    {
        "id": st.text(max_size=6),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.sampled_from(["f", "get_time"]),
                "arguments": st.sampled_from(['{"x": "1"}', "{}", "{not json", '"str"', {"x": 1}]),
            }
        ),
    }
)
assistant_with_calls = st.builds(
    lambda calls, content: {"role": "assistant", "content": content, "tool_calls": calls},
    st.lists(tool_call, min_size=1, max_size=2),
    st.one_of(st.none(), st.text(max_size=10)),
)
junk_message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": edge_or_junk("function", "bogus", "USER", None, 3, ""),
            "content": st.one_of(valid_content, st.none()),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "tool"]),
            "content": edge_or_junk(
                None,
                5,
                {"text": "x"},
                [5],
                [{"type": "text"}],
                [{"text": "x"}],
                [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                [{"type": "image_url", "image_url": "http://x"}],
                [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                "lorem ipsum " * 300,  # beyond the tiny model's 256-token context
            ),
        },
        optional={
            "tool_calls": edge_or_junk("x", [{}], [{"function": {"name": "f", "arguments": 5}}]),
            "name": any_json,
            "reasoning_content": any_json,
        },
    ),
    any_json,
)
valid_messages = st.lists(st.one_of(valid_message, assistant_with_calls), min_size=1, max_size=4)
junk_messages = st.one_of(
    st.tuples(valid_messages, junk_message, st.integers(0, 4)).map(
        lambda t: [*t[0][: t[2]], t[1], *t[0][t[2] :]]
    ),
    edge_or_junk([], "hi", [{}], {"role": "user", "content": "x"}),
)
tool = st.builds(
    lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
    st.sampled_from(["f", "get_time"]),
    st.sampled_from([PARAMS, {}, None]),
)

BAD_STREAM = edge_or_junk("true", 1, 0)
# Always sent, mostly small: a tiny model left to the context limit takes ~100x longer.
MAX_TOKENS = st.sampled_from([1, 2, 3, None])
BAD_MAX_TOKENS = edge_or_junk(*INT_EDGES, 1.5, "3")
SAMPLING = {  # field: (valid values, edge values)
    "temperature": (st.sampled_from([0, 0.0, 0.5, 1, 1.7, 2]), NUMBER_EDGES),
    "top_p": (st.sampled_from([0.1, 0.9, 1]), NUMBER_EDGES),
    "top_k": (st.sampled_from([0, 1, 5, 40, -1]), (*INT_EDGES, 511, 512, 513, 49152, 10**6)),
    "min_p": (st.sampled_from([0, 0.05, 0.5, 1]), NUMBER_EDGES),
    "repetition_penalty": (st.sampled_from([0.5, 1, 1.3]), NUMBER_EDGES),
    "frequency_penalty": (st.sampled_from([-2, 0, 0.5, 2]), NUMBER_EDGES),
    "presence_penalty": (st.sampled_from([-2, 0, 0.5, 2]), NUMBER_EDGES),
    "n": (st.sampled_from([1, 1, 2, 3, 16]), INT_EDGES),
    "stop": (
        st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=4)),
        ([" world"], ["42", "."], "", [""], ["x"] * 16, ["x"] * 20, [1, 2], [None], {"a": 1}),
    ),
    "stop_token_ids": (st.lists(st.integers(0, 600), max_size=3), ([-1], [2**70], ["1"], 5)),
    "seed": (
        st.integers(-(2**63), 2**64 - 1),
        (2**64, -(2**63) - 1, 10**30, 1.5, "1", True),
    ),
    "stream_options": (
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        ({"include_usage": "yes"}, [], "x", {"include_usage": True, "continuous": True}),
    ),
    "min_tokens": (st.integers(0, 3), (-1, 10**12, "1", 1.5)),
    "ignore_eos": (st.booleans(), ("yes", 1)),
    "skip_special_tokens": (st.booleans(), ("no", 0)),
    "user": (st.text(max_size=10), (5, {})),
}
EXTRAS = {  # fields real clients send that the node ignores
    "metadata": (st.just({"user_id": "u"}), ()),
    "store": (st.booleans(), ()),
    "service_tier": (st.just("auto"), ()),
    "logit_bias": (st.just({"50256": -100}), ()),
    "functions": (st.just([{"name": "f"}]), ()),
    "unknown_field": (any_json, ()),
}
CHAT_ONLY = {
    "max_completion_tokens": (st.sampled_from([1, 2, 3, None]), (0, -1, 10**12, 1.5, "3")),
    "logprobs": (st.booleans(), ("yes", 1, 5)),
    "top_logprobs": (st.integers(0, 20), (-1, 21, 10**9, 1.5)),
    "tools": (st.lists(tool, max_size=2), ("tools", [{"type": "function"}], [{"type": "x"}], [5])),
    "tool_choice": (
        st.sampled_from(["auto", "none"]),
        ("required", "bogus", {"type": "function", "function": {"name": "nope"}}, {"type": 5}),
    ),
    "parallel_tool_calls": (st.booleans(), ("no",)),
    "response_format": (
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        ("json", 5, {"type": 5}, {"type": "json_schema", "json_schema": {"schema": PARAMS}}),
    ),
    "chat_template_kwargs": (
        st.dictionaries(st.sampled_from(["enable_thinking", "x"]), st.booleans(), max_size=2),
        (5, "x", [], {"messages": 5}, {"tools": "x"}, {"bos_token": None}, {"raise": 1}),
    ),
    "reasoning_effort": (st.sampled_from(["low", "high"]), (5, [])),
}
COMPLETIONS_ONLY = {
    "echo": (st.booleans(), ("yes", 1)),
    "logprobs": (st.integers(0, 5), (-1, 21, True, 1.5, "2")),
    "suffix": (st.none(), ("x", 5)),
}


def plausible_body(
    required: dict[str, st.SearchStrategy[Any]],
    required_edges: dict[str, st.SearchStrategy[Any]],
    fields: dict[str, tuple[st.SearchStrategy[Any], tuple[Any, ...]]],
) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body, then (half the time) a few of its fields swapped for edges or junk."""
    valid = st.fixed_dictionaries(required, optional={k: v for k, (v, _) in fields.items()})
    keys = sorted({*required_edges, *fields})

    def junk_for(key: str) -> st.SearchStrategy[Any]:
        if key in required_edges:
            return required_edges[key]
        return edge_or_junk(*fields[key][1]) if fields[key][1] else any_json

    swaps = st.one_of(
        st.just({}),
        st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True).flatmap(
            lambda ks: st.fixed_dictionaries({k: junk_for(k) for k in ks})
        ),
    )
    drop_one = st.sampled_from(sorted(required)).map(lambda k: [k])
    drops = st.one_of(st.just([]), st.just([]), st.just([]), drop_one)
    return st.builds(
        lambda b, s, d: _fast({k: v for k, v in {**b, **s}.items() if k not in d}),
        valid,
        swaps,
        drops,
    )


def _fast(body: dict[str, Any]) -> dict[str, Any]:
    """Requests that ignore eos must not run to the context limit: cap them at 2 tokens."""
    long_min = isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 3
    if body.get("ignore_eos") is True or long_min:
        body["max_tokens"] = 2
        body.pop("max_completion_tokens", None)
    return body


def chat_bodies(models: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    model = st.sampled_from(models)
    bad_model = edge_or_junk("no-such-model", "", models[0] + "/", models[0].upper(), None, 5)
    return plausible_body(
        {
            "model": model,
            "messages": valid_messages,
            "stream": st.booleans(),
            "max_tokens": MAX_TOKENS,
        },
        {
            "model": bad_model,
            "messages": junk_messages,
            "stream": BAD_STREAM,
            "max_tokens": BAD_MAX_TOKENS,
        },
        {**SAMPLING, **EXTRAS, **CHAT_ONLY},
    )


def completion_bodies(models: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    model = st.sampled_from(models)
    bad_model = edge_or_junk("no-such-model", "", None, 5)
    prompt = st.one_of(
        st.text(min_size=1, max_size=30),
        st.lists(st.integers(0, 500), min_size=1, max_size=8),
        st.lists(st.integers(0, 500), min_size=1, max_size=8).map(lambda ids: [ids]),
        st.text(min_size=1, max_size=10).map(lambda t: [t]),
    )
    bad_prompt = edge_or_junk(
        "",
        [],
        [[]],
        ["a", "b"],
        [-1],
        [600],
        [49151],
        [49152],
        [10**6],
        [2**64],
        [1.5],
        [True],
        None,
        5,
        "lorem ipsum " * 300,
        [[1], [2]],
    )
    return plausible_body(
        {"model": model, "prompt": prompt, "stream": st.booleans(), "max_tokens": MAX_TOKENS},
        {
            "model": bad_model,
            "prompt": bad_prompt,
            "stream": BAD_STREAM,
            "max_tokens": BAD_MAX_TOKENS,
        },
        {**SAMPLING, **EXTRAS, **COMPLETIONS_ONLY},
    )


def raw_bodies(models: list[str]) -> st.SearchStrategy[bytes]:
    """Bytes that are not a JSON object, or not JSON at all, or JSON Python reads oddly."""
    m = json.dumps(models[0])
    crafted = [
        b"",
        b" \n",
        b"{",
        b"}",
        b"null",
        b"[]",
        b"{}",
        b'"x"',
        b"NaN",
        b"1e999",
        b"\x00",
        b"\xff\xfe{\x00}\x00",
        b"\xef\xbb\xbf{}",
        b'{"model": "\xff"}',
        b'{"model": "x"} trailing',
        f'{{"model": {m}, "messages": [{{"role": "user", "content": "hi"}}],'
        f' "stop": ["\\ud800"], "max_tokens": 2}}'.encode(),
        b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
        f'{{"model": {m}, "messages": [{{"role": "\\ud800", "content": "hi"}}]}}'.encode(),
        f'{{"model": {m}, "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2,'
        f' "model": "no-such-model"}}'.encode(),
        b"[" * 500 + b"]" * 500,  # deep, but within what json.loads handles
    ]
    return st.one_of(
        st.sampled_from(crafted),
        st.binary(max_size=64),
        any_json.map(lambda v: json.dumps(v).encode()),
    )


# -- sending and checking ---------------------------------------------------------------------


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()  # ASCII with \u escapes; NaN/Infinity as Python writes


def post(client: httpx.Client, path: str, payload: bytes) -> tuple[int, httpx.Headers, bytes]:
    headers = {"content-type": "application/json"}
    with client.stream("POST", path, content=payload, headers=headers) as r:
        return r.status_code, r.headers, r.read()


def _show(payload: bytes, limit: int = 600) -> str:
    text = payload.decode(errors="replace")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def check_envelope(status: int, headers: httpx.Headers, raw: bytes) -> None:
    """`{"error": {"message", "type", "code", "param"}}`; Retry-After where SPEC wants one."""
    assert headers["content-type"].startswith("application/json"), dict(headers)
    body = json.loads(raw)
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert "code" in err and "param" in err, body
    if status == 503 or err["code"] == "rate_limit_exceeded":
        assert headers.get("retry-after", "").isdigit(), (body, dict(headers))


def check_answer(sent: Any, status: int, headers: httpx.Headers, raw: bytes) -> None:
    """The contract for any body: a well-formed 200, or an OpenAI error envelope, never 5xx
    (other than a 503 with Retry-After)."""
    where = f"status {status}, response {_show(raw)}"
    assert status in ALLOWED, where
    if status != 200:
        check_envelope(status, headers, raw)
        return
    assert isinstance(sent, dict), f"a non-object body was served: {where}"
    if sent.get("stream") is True:
        assert headers["content-type"].startswith("text/event-stream"), dict(headers)
        events = [e for e in raw.decode().split("\n\n") if e.strip()]
        assert all(e.startswith("data: ") for e in events), where
        assert events and events[-1] == "data: [DONE]", where
        for event in events[:-1]:
            chunk = json.loads(event.removeprefix("data: "))
            assert "error" not in chunk, f"error event in a 200 stream: {where}"
            assert isinstance(chunk["choices"], list), where
        return
    out = json.loads(raw)
    assert isinstance(out["choices"], list) and out["choices"], where
    n = sent.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
        assert len(out["choices"]) == n, where


def exchange(node, path: str, sent: Any, payload: bytes) -> None:
    with httpx.Client(base_url=node.base_url, timeout=30) as client:
        status, headers, raw = post(client, path, payload)
    try:
        check_answer(sent, status, headers, raw)
    except (AssertionError, ValueError, KeyError) as e:
        raise AssertionError(f"POST {path} {_show(payload)}\n-> {e!r}") from e


# -- the properties ---------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_any_chat_completions_body_gets_an_openai_answer_never_a_500(
    node, scripted_id, tiny_id, data
):
    body = data.draw(chat_bodies([scripted_id, tiny_id]), label="body")
    exchange(node, "/v1/chat/completions", body, encode(body))


@FUZZ
@given(data=st.data())
def test_any_completions_body_gets_an_openai_answer_never_a_500(node, scripted_id, tiny_id, data):
    body = data.draw(completion_bodies([scripted_id, tiny_id]), label="body")
    exchange(node, "/v1/completions", body, encode(body))


@FUZZ
@given(data=st.data(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_non_object_and_non_json_bodies_are_a_400_never_a_500(
    node, scripted_id, tiny_id, data, path
):
    payload = data.draw(raw_bodies([scripted_id, tiny_id]), label="payload")
    exchange(node, path, _decoded(payload), payload)


def _decoded(payload: bytes) -> Any:
    """The JSON value `payload` holds, or None when it is not JSON."""
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return None


# -- bugs the fuzz found once, kept as regressions ---------------------------------------------

MESSAGE = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("payload", [b"[" * 5_000, b'{"a":' * 5_000 + b"1" + b"}" * 5_000])
def test_deeply_nested_json_is_a_400_not_a_500(node, payload):
    with httpx.Client(base_url=node.base_url, timeout=30) as client:
        status, headers, raw = post(client, "/v1/chat/completions", payload)
    assert status == 400, (status, raw[:300])
    check_envelope(status, headers, raw)


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud800"}]'),
        ("/v1/completions", '"prompt": "x \\udfff"'),
    ],
)
def test_a_lone_surrogate_in_the_prompt_is_a_400_not_a_500(node, scripted_id, path, fields):
    payload = f'{{"model": {json.dumps(scripted_id)}, {fields}, "max_tokens": 2}}'.encode()
    with httpx.Client(base_url=node.base_url, timeout=30) as client:
        status, headers, raw = post(client, path, payload)
    assert status == 400, (status, raw[:300])
    check_envelope(status, headers, raw)


def test_a_top_k_beyond_int64_is_a_400_not_a_500(node, scripted_id):
    body = {"model": scripted_id, "messages": MESSAGE, "max_tokens": 2, "temperature": 1}
    r = node.post("/v1/chat/completions", {**body, "top_k": 2**63})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_k", r.text


KNOWN_GET = {"/v1/models", "/health", "/discovery", "/version", "/models", "/metrics"}
KNOWN_POST = {"/v1/chat/completions", "/v1/completions", "/models/load", "/models/unload"}
segment = st.one_of(
    st.text(
        alphabet=string.ascii_letters + string.digits + "-_~:@!$&'()*+,;=", min_size=1, max_size=10
    ),
    st.sampled_from(["v1", "models", "endpoint", "chat", "%00", "%FF", "%C3%A9", "é", "%20"]),
)
paths = st.lists(segment, min_size=1, max_size=4).map(lambda s: "/" + "/".join(s))


@settings(FUZZ, max_examples=100)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]), path=paths)
def test_unknown_paths_and_wrong_methods_get_an_openai_404_or_405(node, method, path):
    route = unquote(path).rstrip("/")
    known = KNOWN_GET | KNOWN_POST
    wrong_method = (route in KNOWN_GET and method != "GET") or (
        route in KNOWN_POST and method != "POST"
    )
    if route in known and not wrong_method:
        path = "/nowhere" + path  # never load, unload or run anything from here
    with httpx.Client(base_url=node.base_url, timeout=30) as client:
        r = client.request(method, path, content=b"{}")
    assert r.status_code in (404, 405), (method, path, r.status_code, r.text[:300])
    check_envelope(r.status_code, r.headers, r.content)


def test_known_routes_with_the_wrong_method_get_an_openai_405(node):
    with httpx.Client(base_url=node.base_url, timeout=30) as client:
        for method, path in [
            ("GET", "/v1/chat/completions"),
            ("GET", "/v1/completions"),
            ("PUT", "/v1/chat/completions"),
            ("POST", "/health"),
            ("DELETE", "/v1/models"),
            ("POST", "/version"),
            ("PATCH", "/metrics"),
            ("GET", "/models/unload"),  # the POST route wins over GET /models/{id}
        ]:
            r = client.request(method, path)
            assert r.status_code == 405, (method, path, r.status_code, r.text[:300])
            check_envelope(r.status_code, r.headers, r.content)


def test_the_node_survives_a_fuzz_with_every_slot_released(node, scripted_id, tiny_id):
    """A burst of all three kinds of bodies of its own (so that alone, or in any order, it
    has something to survive), then: nothing leaked, nothing stuck, still serving."""
    models = [scripted_id, tiny_id]
    sent_bodies: list[bytes] = []

    @settings(FUZZ, max_examples=60)
    @given(data=st.data(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def burst(data, path):
        bodies = (
            chat_bodies(models) if path == "/v1/chat/completions" else completion_bodies(models)
        )
        payload = data.draw(st.one_of(bodies.map(encode), raw_bodies(models)), label="payload")
        sent_bodies.append(payload)
        exchange(node, path, _decoded(payload), payload)

    burst()
    assert len(sent_bodies) >= 30  # the burst ran (hypothesis may stop short of 60)
    assert node.proc.poll() is None, node.log()[-4000:]
    deadline = time.monotonic() + 30  # a hang guard: slots come back as their requests end
    while True:
        health = node.get("/health").json()["models"]
        busy = [m for m in health if m["in_flight"] or m["queue_depth"]]
        if not busy:
            break
        assert time.monotonic() < deadline, f"slots still held after the fuzz: {busy}"
        time.sleep(0.2)
    assert {m["status"] for m in health} == {"loaded"}, health
    body = {"model": scripted_id, "messages": MESSAGE, "max_tokens": 64}
    r = node.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == SCRIPT
