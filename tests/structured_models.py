"""What the structured-output server tests share: tiny random models with the Qwen3
vocabulary (its tool-call markers), the schemas and tools they ask for, a pydantic model for
the openai SDK's `parse`, and the check that an answer is valid."""

from __future__ import annotations

import enum
import json
import shutil
from pathlib import Path
from typing import Annotated, Any

import jsonschema
from pydantic import BaseModel, Field

from tests.engine.tiny import FIXTURE_MODELS, make_tiny_model

QWEN3 = "Qwen3-0.6B"
QWEN3_CODER_TEMPLATE = "Qwen3-Coder-30B-A3B-Instruct/Qwen3-Coder.jinja"
QWEN3_VOCAB = 151936  # Qwen3's embedding rows: its tokenizer knows 151669 ids
TOOL_CALL_ID = 151657  # `<tool_call>` in the Qwen3 vocabulary


def qwen3_random_model(root: Path, name: str, *, xml_calls: bool = False) -> Path:
    """A tiny random qwen3 model speaking through the Qwen3 tokenizer: its own template
    (Hermes JSON calls), or with `xml_calls` Qwen3-Coder's (Qwen XML calls)."""
    model_dir, _ = make_tiny_model(
        "qwen3", root / name, vocab_size=QWEN3_VOCAB, max_position_embeddings=4096
    )
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURE_MODELS / QWEN3 / f, model_dir / f)
    (model_dir / "special_tokens_map.json").unlink(missing_ok=True)  # SmolLM2's
    if xml_calls:
        shutil.copyfile(FIXTURE_MODELS / QWEN3_CODER_TEMPLATE, model_dir / "chat_template.jinja")
    return model_dir


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


# Strings bounded (or enums) so a random model's answers end within max_tokens.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": _object(
        {
            "user": _object(
                {
                    "name": {"type": "string", "maxLength": 8},
                    "admin": {"type": "boolean"},
                    "address": _object({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                }
            ),
            "active": {"type": "boolean"},
        }
    ),
    "enum": _object(
        {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "level": {"enum": [1, 2, 3, None]},
        }
    ),
    "array": _object(
        {
            "xs": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 2,
                "maxItems": 4,
            },
            "words": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "maxItems": 3,
            },
        }
    ),
    "nullable": _object(
        {
            "nick": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
            "score": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "null"}]
            },
        }
    ),
    "integers": _object(
        {
            "small": {"type": "integer", "minimum": -5, "maximum": 5},
            "big": {"type": "integer", "minimum": 100, "maximum": 1000},
            "positive": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
        }
    ),
}


class Color(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    """What `chat.completions.parse` asks for: pydantic gives `maxLength`, `maxItems`,
    an enum through `$ref`; the SDK makes it strict (`additionalProperties: false`)."""

    name: str = Field(max_length=10)
    age: int
    color: Color
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=3)


def validate(text: str, schema: dict[str, Any]) -> Any:
    """`text` parsed as JSON and checked against `schema`; a clear AssertionError if not."""
    try:
        value = json.loads(text)
        jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        ).validate(value)
    except (ValueError, jsonschema.ValidationError) as e:
        raise AssertionError(f"not valid for {json.dumps(schema)}:\n{text!r}\n{e}") from None
    return value


def response_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def function_tool(name: str, parameters: dict[str, Any], *, strict: bool = False) -> dict:
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


# Tools whose arguments a random model can finish: enums, bounded integers, booleans.
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": _object(
        {
            "city": {"enum": ["Oslo", "Paris", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        }
    ),
    "get_time": _object(
        {"zone": {"enum": ["UTC", "CET"]}, "h24": {"type": "boolean"}}, required=["zone"]
    ),
}
