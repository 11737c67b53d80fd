"""Schemas for the structured-output tests, drawn by hypothesis-jsonschema.

hypothesis-jsonschema draws instances of a schema; a JSON schema's instances are schemas when
the schema is a metaschema. Its generator cannot follow the recursive `$ref: "#"` of the
official metaschemas, so `metaschema(depth)` unrolls one, over the keywords structured output
enforces (helexa.protocol.structured), `depth` levels deep. `draw_schemas(n)` draws `n`
of them, reproducibly, and tidies what a metaschema cannot say (`required` names that are
not among the `properties`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

NAMES = ["id", "name", "tags", "when"]
SHORT_TEXT = {"type": "string", "pattern": "^[A-Za-z0-9 é]{1,6}$"}
LEAVES: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "type": {"const": "string"},
            "minLength": {"type": "integer", "minimum": 0, "maximum": 3},
            "maxLength": {"type": "integer", "minimum": 3, "maximum": 16},
        },
        "required": ["type"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "string"},
            "format": {"enum": ["date", "email", "uuid", "ipv4", "date-time", "time"]},
        },
        "required": ["type", "format"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "string"},
            "pattern": {"enum": ["^[a-z]{2,5}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"]},
        },
        "required": ["type", "pattern"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "integer"},
            "minimum": {"type": "integer", "minimum": -50, "maximum": 0},
            "maximum": {"type": "integer", "minimum": 1, "maximum": 1000},
        },
        "required": ["type"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "number"},
            "minimum": {"type": "integer", "minimum": -5, "maximum": 0},
            "exclusiveMaximum": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        "required": ["type"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"type": {"enum": ["boolean", "null"]}},
        "required": ["type"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "enum": {
                "type": "array",
                "items": {"anyOf": [SHORT_TEXT, {"type": "integer"}, {"type": "boolean"}]},
                "minItems": 1,
                "maxItems": 4,
                "uniqueItems": True,
            }
        },
        "required": ["enum"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"const": SHORT_TEXT},
        "required": ["const"],
        "additionalProperties": False,
    },
]


def metaschema(depth: int) -> dict[str, Any]:
    """Schemas of objects whose properties are leaves, arrays, objects or anyOf, `depth`
    levels of nesting below the top object (as structured output's schemas are)."""
    return _node(depth, top=True)


def _node(depth: int, *, top: bool = False) -> dict[str, Any]:
    if depth == 0:
        return {"anyOf": LEAVES}
    child = _node(depth - 1)
    branches = [
        *LEAVES,
        {
            "type": "object",
            "properties": {
                "type": {"const": "object"},
                "properties": {
                    "type": "object",
                    "properties": {name: child for name in NAMES},
                    "additionalProperties": False,
                    "minProperties": 1,
                },
                "required": {"type": "array", "items": {"enum": NAMES}, "maxItems": 4},
                "additionalProperties": {"const": False},
            },
            "required": ["type", "properties", "additionalProperties"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "array"},
                "items": child,
                "minItems": {"type": "integer", "minimum": 0, "maximum": 2},
                "maxItems": {"type": "integer", "minimum": 2, "maximum": 4},
            },
            "required": ["type", "items", "maxItems"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "anyOf": {"type": "array", "items": child, "minItems": 2, "maxItems": 3}
            },
            "required": ["anyOf"],
            "additionalProperties": False,
        },
    ]
    return branches[len(LEAVES)] if top else {"anyOf": branches}


def tidy(schema: Any) -> Any:
    """`required` kept to the names among `properties` (a metaschema cannot tie them)."""
    if isinstance(schema, dict):
        out = {k: tidy(v) for k, v in schema.items()}
        if "required" in out:
            out["required"] = sorted({n for n in out["required"] if n in out.get("properties", {})})
        return out
    if isinstance(schema, list):
        return [tidy(v) for v in schema]
    return schema


def draw_schemas(n: int, *, depth: int = 1, seed: int = 0) -> list[dict[str, Any]]:
    """`n` distinct schemas, the same ones every run (`seed`). Drawing takes minutes:
    the tests read them from DRAWN (`python -m tests.structured.schemas` writes it)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis_jsonschema import from_schema

    drawn: dict[str, dict[str, Any]] = {}

    @hseed(seed)
    @settings(
        max_examples=n * 4,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(from_schema(metaschema(depth)))
    def collect(schema: dict[str, Any]) -> None:
        if len(drawn) < n:
            schema = tidy(schema)
            drawn.setdefault(json.dumps(schema, sort_keys=True), schema)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collect()
    return list(drawn.values())


DRAWN = Path(__file__).with_name("drawn_schemas.json")


def load_drawn() -> list[dict[str, Any]]:
    return json.loads(DRAWN.read_text())


if __name__ == "__main__":
    DRAWN.write_text(json.dumps(draw_schemas(200), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {DRAWN}")
