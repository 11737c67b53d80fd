"""OpenAI request parsing: real client traffic parses, bad bodies are 400s naming the field."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from helexa.errors import HelexaError
from helexa.node.sampling import to_sampling_params
from helexa.protocol.openai import (
    ChatCompletionRequest,
    parse_chat_request,
    parse_completion_request,
    template_messages,
    template_tools,
)
from tests.shared_fixtures import TRAFFIC_DIR, need_shared


def _opencode_bodies() -> list[tuple[str, dict[str, Any]]]:
    files = sorted((TRAFFIC_DIR / "opencode").glob("*.json"))
    return [(f.name, json.loads(f.read_text())["body"]) for f in files]


def _chat(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(overrides)
    return body


def _tools(*names: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "parameters": {}}} for n in names]


@pytest.mark.parametrize("name", [n for n, _ in _opencode_bodies()] or ["<none>"])
def test_every_opencode_request_parses_and_maps_to_sampling_params(name: str) -> None:
    need_shared(TRAFFIC_DIR / "opencode" / name)
    body = dict(_opencode_bodies())[name]
    req = parse_chat_request(body)
    params = to_sampling_params(req)
    assert params.max_tokens == body["max_tokens"]
    assert len(req.tools) == len(body.get("tools", []))
    assert req.stream is True and req.include_usage is True
    assert req.reasoning_effort == body.get("reasoning_effort")
    messages = template_messages(req)
    assert [m["role"] for m in messages] == [m["role"] for m in body["messages"]]
    for sent, kept in zip(body["messages"], messages, strict=True):
        assert kept.get("reasoning_content") == sent.get("reasoning_content")
        assert kept.get("tool_call_id") == sent.get("tool_call_id")
        assert len(kept.get("tool_calls", [])) == len(sent.get("tool_calls", []))
    names = [t["function"]["name"] for t in template_tools(req) or []]
    assert names == [t["function"]["name"] for t in body.get("tools", [])]


def test_reasoning_content_echoed_by_opencode_is_kept_on_the_assistant_turn() -> None:
    name = "011-reasoning-content-echo-post-v1-chat-completions.json"
    bodies = dict(_opencode_bodies())
    need_shared(TRAFFIC_DIR / "opencode" / name)
    assistant = template_messages(parse_chat_request(bodies[name]))[2]
    assert assistant["role"] == "assistant"
    assert assistant["reasoning_content"] == "Canned capture-server reasoning."
    assert assistant["tool_calls"][0]["function"]["name"] == "bash"


BAD_CHAT_BODIES: list[tuple[str, object, str | None]] = [
    ("not an object", ["model"], "body"),
    ("model missing", {"messages": [{"role": "user", "content": "x"}]}, "model"),
    ("model not a string", _chat(model=7), "model"),
    ("messages missing", {"model": "m"}, "messages"),
    ("empty messages", _chat(messages=[]), "messages"),
    ("message not an object", _chat(messages=["hi"]), "messages[0]"),
    ("message without role", _chat(messages=[{"content": "x"}]), "messages[0].role"),
    ("unknown role", _chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    ("function role", _chat(messages=[{"role": "function", "content": "x"}]), "messages[0].role"),
    (
        "content wrong type",
        _chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": 5}]),
        "messages[1].content",
    ),
    (
        "user content null",
        _chat(messages=[{"role": "user", "content": None}]),
        "messages[0].content",
    ),
    (
        "text part without text",
        _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages[0].content[0].text",
    ),
    (
        "image part without url",
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].image_url.url",
    ),
    (
        "tool call arguments a number",
        _chat(
            messages=[
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": 3}}],
                }
            ]
        ),
        "messages[0].tool_calls[0].function.arguments",
    ),
    ("temperature hot", _chat(temperature="hot"), "temperature"),
    ("temperature negative", _chat(temperature=-1), "temperature"),
    ("temperature a boolean", _chat(temperature=True), "temperature"),
    ("top_p zero", _chat(top_p=0), "top_p"),
    ("top_logprobs without logprobs", _chat(top_logprobs=2), "top_logprobs"),
    ("top_logprobs too many", _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("logprobs an integer", _chat(logprobs=1), "logprobs"),
    ("n zero", _chat(n=0), "n"),
    ("n too large", _chat(n=17), "n"),
    ("max_tokens zero", _chat(max_tokens=0), "max_tokens"),
    ("max_tokens a boolean", _chat(max_tokens=True), "max_tokens"),
    ("max_tokens a float", _chat(max_tokens=10.5), "max_tokens"),
    ("max_completion_tokens negative", _chat(max_completion_tokens=-3), "max_completion_tokens"),
    ("seed a string", _chat(seed="1"), "seed"),
    ("stop of 17 strings", _chat(stop=[str(i) for i in range(17)]), "stop"),
    ("stop holding a number", _chat(stop=["a", 1]), "stop[1]"),
    ("stream a string", _chat(stream="yes"), "stream"),
    (
        "include_usage a string",
        _chat(stream_options={"include_usage": "y"}),
        "stream_options.include_usage",
    ),
    ("tools not a list", _chat(tools={"type": "function"}), "tools"),
    (
        "tool without name",
        _chat(tools=[{"type": "function", "function": {}}]),
        "tools[0].function.name",
    ),
    ("tool of another type", _chat(tools=[{"type": "web_search"}]), "tools[0].type"),
    ("tool_choice unknown string", _chat(tool_choice="always"), "tool_choice"),
    ("tool_choice required without tools", _chat(tool_choice="required"), "tools"),
    (
        "tool_choice naming a function not in tools",
        _chat(tools=_tools("a"), tool_choice={"type": "function", "function": {"name": "b"}}),
        "tool_choice.function.name",
    ),
    ("chat_template_kwargs a list", _chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    ("stop_token_ids negative", _chat(stop_token_ids=[-1]), "stop_token_ids[0]"),
    ("temperature overflowing a float", _chat(temperature=10**400), "temperature"),
    ("temperature nan", _chat(temperature=float("nan")), "temperature"),
]


@pytest.mark.parametrize(
    ("case", "body", "param"), BAD_CHAT_BODIES, ids=[c[0] for c in BAD_CHAT_BODIES]
)
def test_a_bad_chat_body_is_a_400_naming_the_field(case: str, body: object, param: str) -> None:
    with pytest.raises(HelexaError) as info:
        to_sampling_params(parse_chat_request(body))
    error = info.value
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param)
    assert error.message.startswith(param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": [[1, 2], [3]]}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt[1]"),
        ({"model": "m", "prompt": [[1, True]]}, "prompt[0][1]"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "prompt": "x", "echo": 1}, "echo"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ],
)
def test_a_bad_completion_body_is_a_400_naming_the_field(body: object, param: str) -> None:
    with pytest.raises(HelexaError) as info:
        parse_completion_request(body)
    assert (info.value.status, info.value.param) == (400, param)


def test_batch_prompts_are_refused_with_a_clear_message() -> None:
    with pytest.raises(HelexaError, match="batch prompts are not supported"):
        parse_completion_request({"model": "m", "prompt": ["a", "b"]})


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", "hi"), (["hi"], "hi"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_completion_prompts_of_every_single_prompt_shape_are_accepted(
    prompt: object, expected: object
) -> None:
    req = parse_completion_request({"model": "m", "prompt": prompt, "logprobs": 3, "echo": True})
    assert req.prompt == expected
    assert to_sampling_params(req).logprobs == 3


def test_unknown_top_level_and_nested_fields_are_ignored() -> None:
    body = _chat(
        messages=[
            {"role": "system", "content": "s", "cache_control": {"type": "ephemeral"}},
            {"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]},
        ],
        tools=[{"type": "function", "function": {"name": "f", "strict": True}, "x": 2}],
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        metadata={"user_id": "u"},
        store=False,
        service_tier="auto",
        provider={"order": ["x"]},
    )
    req = parse_chat_request(body)
    assert req.include_usage is True
    assert template_messages(req)[1] == {"role": "user", "content": "a"}
    assert template_tools(req) == [{"type": "function", "function": {"name": "f"}}]


def test_max_completion_tokens_wins_over_max_tokens_and_the_default_fills_in() -> None:
    assert to_sampling_params(parse_chat_request(_chat(max_tokens=5))).max_tokens == 5
    both = parse_chat_request(_chat(max_tokens=5, max_completion_tokens=9))
    assert to_sampling_params(both).max_tokens == 9
    neither = parse_chat_request(_chat())
    assert to_sampling_params(neither, max_tokens_default=77).max_tokens == 77
    assert to_sampling_params(neither).max_tokens is None


def test_sampling_fields_map_onto_the_engine_params() -> None:
    req = parse_chat_request(
        _chat(
            temperature=0,
            top_p=0.5,
            top_k=-1,
            min_p=0.1,
            repetition_penalty=1.1,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            seed=42,
            stop="END",
            stop_token_ids=[7],
            ignore_eos=True,
            logprobs=True,
            top_logprobs=3,
        )
    )
    params = to_sampling_params(req)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 0.5, 0, 0.1)
    assert (params.repetition_penalty, params.frequency_penalty) == (1.1, 0.5)
    assert (params.presence_penalty, params.seed) == (-0.5, 42)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == (["END"], [7], True)
    assert params.logprobs == 3
    assert to_sampling_params(parse_chat_request(_chat(logprobs=True))).logprobs == 0
    assert to_sampling_params(parse_chat_request(_chat())).logprobs is None


def test_all_text_parts_are_joined_and_image_parts_are_kept() -> None:
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    image = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x"}}]
    req = parse_chat_request(
        _chat(messages=[{"role": "user", "content": text}, {"role": "user", "content": image}])
    )
    messages = template_messages(req)
    assert messages[0]["content"] == "a\nb"
    assert messages[1]["content"] == image


def test_assistant_tool_call_turns_may_have_null_content_and_keep_string_arguments() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    req = parse_chat_request(
        _chat(
            messages=[
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ],
            tools=_tools("f"),
            tool_choice={"type": "function", "function": {"name": "f"}},
        )
    )
    assert template_messages(req)[1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert req.tool_choice == {"type": "function", "function": {"name": "f"}}


def test_tool_choice_none_hides_the_tools_from_the_template() -> None:
    req = parse_chat_request(_chat(tools=_tools("f"), tool_choice="none"))
    assert template_tools(req) is None


def test_integers_are_accepted_where_floats_are_expected() -> None:
    req = parse_chat_request(_chat(temperature=1, top_p=1, presence_penalty=0))
    assert isinstance(req.temperature, float) and req.temperature == 1.0


def _random_json(rng: random.Random, depth: int = 0) -> object:
    scalars: list[object] = [
        None,
        True,
        False,
        0,
        1,
        -1,
        2**70,
        0.5,
        -1e308,
        float("inf"),
        "",
        "x",
        "user",
        "function",
    ]
    if depth > 2 or rng.random() < 0.5:
        return rng.choice(scalars)
    if rng.random() < 0.5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["role", "content", "type", "text", "function", "name", "image_url", "url", "zz"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _mutations(base: dict[str, Any], rng: random.Random) -> object:
    """`base` with one field, possibly nested, replaced by a random JSON value."""
    body = copy.deepcopy(base)
    node: Any = body
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return body
        key = rng.choice(keys)
        child = node[key]
        if isinstance(child, dict | list) and child and rng.random() < 0.6:
            node = child
            continue
        node[key] = _random_json(rng)
        return body


def test_random_and_mistyped_bodies_raise_only_the_400_error() -> None:
    rng = random.Random(1234)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat_base = _chat(
        messages=[
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}]},
            {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "out"},
        ],
        tools=_tools("f"),
        tool_choice={"type": "function", "function": {"name": "f"}},
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.7,
        stop=["x"],
        logprobs=True,
        top_logprobs=2,
        max_tokens=10,
        seed=1,
    )
    completion_base = {"model": "m", "prompt": [[1, 2]], "max_tokens": 3, "echo": False}
    outcomes = {"ok": 0, "400": 0}
    for i in range(3000):
        body = _random_json(rng) if i % 10 == 0 else _mutations(chat_base, rng)
        for parse, candidate in (
            (parse_chat_request, body),
            (parse_completion_request, _mutations(completion_base, rng)),
        ):
            try:
                req = parse(candidate)
                to_sampling_params(req)
                if isinstance(req, ChatCompletionRequest):
                    template_messages(req)
                    template_tools(req)
                outcomes["ok"] += 1
            except HelexaError as e:
                assert e.status == 400 and e.type == "invalid_request_error" and e.param
                outcomes["400"] += 1
    assert outcomes["ok"] > 100 and outcomes["400"] > 100
