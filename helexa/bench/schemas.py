"""Hand-written JSON schemas that `helexa bench grammar` and the structured-output tests share,
each with one valid instance (`EXAMPLES`, its keys in the schema's order: the grammar
engines emit properties in that order).

They use only what the grammar engine enforces (helexa.protocol.structured lists it): type,
properties, required, additionalProperties, items, prefixItems, min/maxItems, enum, const,
anyOf, oneOf, a single allOf, $ref with $defs or definitions, min/maxLength, pattern, the
formats date, time, date-time, email, uuid, ipv4, ipv6, hostname and uri, and the numeric
bounds; title, description and default are annotations.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, Field

CITY: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}

_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 60},
        "city": {"type": "string"},
        "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["street", "city", "postcode"],
    "additionalProperties": False,
}

# Claude Code's `Bash` tool, as its tool definition spells the parameters.
BASH_TOOL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The command to execute"},
        "timeout": {
            "type": "number",
            "description": "Optional timeout in milliseconds (max 600000)",
        },
        "description": {
            "type": "string",
            "description": "Clear, concise description of what this command does in 5-10 words",
        },
        "run_in_background": {
            "type": "boolean",
            "description": "Set to true to run this command in the background",
        },
    },
    "required": ["command"],
    "additionalProperties": False,
}


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Dimensions(BaseModel):
    width_cm: float = Field(gt=0)
    height_cm: float = Field(gt=0, le=500)


class Product(BaseModel):
    """A product listing, as a pydantic user would declare it."""

    name: str = Field(max_length=40)
    color: Color
    size: Dimensions
    ratings: list[Annotated[int, Field(ge=1, le=5)]] = Field(min_length=1, max_length=5)
    discount: float | None = None


HAND_SCHEMAS: dict[str, dict[str, Any]] = {
    "city": CITY,
    # three levels of objects inside the outer one
    "nested": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer"},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "contact": {
                        "type": "object",
                        "properties": {
                            "email": {"type": "string", "format": "email"},
                            "phone": {"type": "string"},
                        },
                        "required": ["email"],
                    },
                },
                "required": ["name", "contact"],
            },
            "paid": {"type": "boolean"},
        },
        "required": ["order_id", "customer", "paid"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "priority": {"type": "string", "enum": ["low", "normal", "high"]},
            "mixed": {"enum": ["auto", 0, 1.5, True, None]},
        },
        "required": ["status", "priority", "mixed"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                "maxItems": 3,
            },
            "point": {
                "type": "array",
                "prefixItems": [{"type": "number"}, {"type": "number"}, {"type": "string"}],
                "items": False,
            },
        },
        "required": ["tags", "matrix", "point"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer"}, {"type": "string", "format": "uuid"}]},
            "nickname": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
            "shape": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
                        "required": ["kind", "radius"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                        "required": ["kind", "side"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
        "required": ["id", "nickname", "shape"],
    },
    "refs": {
        "type": "object",
        "properties": {
            "home": {"$ref": "#/$defs/address"},
            "work": {"$ref": "#/$defs/address"},
            "owner": {"$ref": "#/definitions/person"},
        },
        "required": ["home", "owner"],
        "$defs": {"address": _ADDRESS},
        "definitions": {
            "person": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name"],
            }
        },
    },
    # recursive: a node's children are nodes; maxItems bounds how wide each level grows
    "tree": {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 16},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["label", "children"],
                "additionalProperties": False,
            }
        },
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "floor": {"type": "integer", "minimum": -3, "maximum": 120},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "temperature": {"type": "number", "minimum": -273.15},
        },
        "required": ["age", "floor", "ratio", "temperature"],
    },
    "strings": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "title": {"type": "string", "minLength": 3, "maxLength": 30},
            "born": {"type": "string", "format": "date"},
            "email": {"type": "string", "format": "email"},
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["code", "title", "born", "email", "id"],
        "additionalProperties": False,
    },
    "formats": {
        "type": "object",
        "properties": {
            "at": {"type": "string", "format": "date-time"},
            "opens": {"type": "string", "format": "time"},
            "host": {"type": "string", "format": "hostname"},
            "v4": {"type": "string", "format": "ipv4"},
            "v6": {"type": "string", "format": "ipv6"},
            "site": {"type": "string", "format": "uri"},
        },
        "required": ["at", "opens", "host", "v4", "v6", "site"],
    },
    "const": {
        "title": "Event",
        "allOf": [
            {
                "type": "object",
                "properties": {
                    "version": {"const": 2},
                    "kind": {"const": "event"},
                    "name": {"type": "string", "description": "what happened"},
                    "retries": {"type": "integer", "default": 0},
                },
                "required": ["version", "kind", "name"],
                "additionalProperties": False,
            }
        ],
    },
    "pydantic": Product.model_json_schema(),
    "bash_tool": BASH_TOOL,
}

# One valid instance per schema, keys in schema order.
EXAMPLES: dict[str, Any] = {
    "city": {"city": "Paris"},
    "nested": {
        "order_id": 1042,
        "customer": {
            "name": "Ada Lovelace",
            "contact": {"email": "ada@example.org", "phone": "+44 20 7946 0000"},
        },
        "paid": True,
    },
    "enums": {"status": "shipped", "priority": "high", "mixed": None},
    "arrays": {
        "tags": ["red", "large", "sale"],
        "matrix": [[1, 2, 3], [4, 5], []],
        "point": [1.5, -2, "A"],
    },
    "any_of": {
        "id": "3f2b8c1e-9d4a-4e6f-8b2c-1a2b3c4d5e6f",
        "nickname": None,
        "shape": {"kind": "square", "side": 2.5},
    },
    "refs": {
        "home": {"street": "12 Rue de Rivoli", "city": "Paris", "postcode": "75001"},
        "work": {"street": "1 Avenue Foch", "city": "Paris", "postcode": "75116"},
        "owner": {"name": "Marie", "age": 34},
    },
    "tree": {
        "label": "root",
        "children": [
            {"label": "a", "children": [{"label": "a1", "children": []}]},
            {"label": "b", "children": []},
        ],
    },
    "numbers": {"age": 37, "floor": -2, "ratio": 0.25, "temperature": 21.5},
    "strings": {
        "code": "ABC-1234",
        "title": "Quarterly report",
        "born": "1990-05-17",
        "email": "someone@example.com",
        "id": "123e4567-e89b-12d3-a456-426614174000",
    },
    "formats": {
        "at": "2024-03-01T12:30:00Z",
        "opens": "09:00:00Z",
        "host": "api.example.com",
        "v4": "192.168.1.20",
        "v6": "2001:db8::1",
        "site": "https://example.com/docs?page=2",
    },
    "const": {"version": 2, "kind": "event", "name": "deploy finished", "retries": 1},
    "pydantic": {
        "name": "Desk lamp",
        "color": "green",
        "size": {"width_cm": 20.0, "height_cm": 45.5},
        "ratings": [5, 4, 4],
        "discount": None,
    },
    "bash_tool": {
        "command": "ls -la /tmp",
        "timeout": 120000,
        "description": "List the files in /tmp",
        "run_in_background": False,
    },
}
