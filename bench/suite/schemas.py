"""Twenty JSON schemas for the structured-output benchmark and the library comparison.

They cover what clients send: flat records, nesting, arrays, enums, bounded
numbers, optional fields, string patterns and formats, ``anyOf`` and ``$ref``.
:func:`endless` wraps one so a row can never finish it within a benchmark's
``max_tokens`` (the random benchmark models never choose to stop, and a
finished grammar forces EOS): decode speed is then measured over whole runs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FEATURES", "SCHEMAS", "endless"]


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


_STR = {"type": "string", "maxLength": 24}
_INT = {"type": "integer", "minimum": 0, "maximum": 1000}

SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _STR, "age": _INT}),
    _obj({"city": _STR, "temperature": {"type": "number"}, "unit": {"enum": ["C", "F"]}}),
    _obj({"id": _INT, "tags": {"type": "array", "items": _STR, "maxItems": 4}}),
    _obj({"user": _obj({"name": _STR, "email": {"type": "string", "format": "email"}})}),
    _obj({"ok": {"type": "boolean"}, "reason": _STR}, required=["ok"]),
    _obj({"title": _STR, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": _INT}),
    _obj({"when": {"type": "string", "format": "date-time"}, "what": _STR}),
    _obj({"points": {"type": "array", "items": _obj({"x": _INT, "y": _INT}), "maxItems": 3}}),
    _obj({"level": {"enum": ["debug", "info", "warning", "error"]}, "message": _STR}),
    _obj({"a": _STR, "b": _STR, "c": _STR, "d": _STR, "e": _STR, "f": _STR}),
    _obj({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}}),
    {
        "$defs": {"item": _obj({"name": _STR, "price": {"type": "number", "minimum": 0}})},
        **_obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 3}}),
    },
    _obj(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": _INT, "maxItems": 3},
                "maxItems": 3,
            }
        }
    ),
    _obj(
        {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        }
    ),
    _obj({"answer": {"const": "yes"}, "confidence": {"type": "number"}}),
    _obj({"name": _STR, "nickname": _STR, "age": _INT}, required=["name"]),
    _obj(
        {
            "order": _obj(
                {
                    "id": _INT,
                    "lines": {
                        "type": "array",
                        "maxItems": 2,
                        "items": _obj({"sku": _STR, "n": _INT}),
                    },
                }
            )
        }
    ),
    _obj({"code": {"type": "string", "minLength": 2, "maxLength": 2}, "count": _INT}),
    {"type": "array", "items": _obj({"k": _STR, "v": _INT}), "minItems": 1, "maxItems": 5},
]

#: One schema per JSON-schema feature, for the library comparison's coverage table.
FEATURES: dict[str, dict[str, Any]] = {
    "nested objects": _obj({"a": _obj({"b": _obj({"c": _INT})})}),
    "arrays minItems/maxItems": {"type": "array", "items": _INT, "minItems": 1, "maxItems": 3},
    "enum": {"enum": ["a", "b", 3, None]},
    "const": {"const": "x"},
    "integer bounds": {"type": "integer", "minimum": 3, "maximum": 17},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "string pattern": {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"},
    "string min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "optional properties": _obj({"a": _INT, "b": _INT}, required=["a"]),
    "additionalProperties false": _obj({"a": _INT}),
    "additionalProperties schema": {"type": "object", "additionalProperties": _INT},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [_obj({"a": _INT}), _obj({"b": _STR})]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": _INT}}, {"required": ["a"]}]},
    "$ref to $defs": {"$defs": {"x": _INT}, "type": "array", "items": {"$ref": "#/$defs/x"}},
    "recursive $ref": {
        "$defs": {
            "node": _obj({"v": _INT, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}})
        },
        "$ref": "#/$defs/node",
    },
    "prefixItems": {"type": "array", "prefixItems": [_INT, _STR], "items": False},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": _INT}},
    "minProperties": {"type": "object", "minProperties": 1},
    "uniqueItems": {"type": "array", "items": _INT, "uniqueItems": True},
    "type list (nullable)": {"type": ["string", "null"]},
}


def endless(schema: dict[str, Any]) -> dict[str, Any]:
    """An array of ``schema`` values that needs far more tokens than any benchmark run."""
    items = {k: v for k, v in schema.items() if k != "$defs"}
    defs = {"$defs": schema["$defs"]} if "$defs" in schema else {}  # refs point at the root
    return {**defs, "type": "array", "items": items, "minItems": 10_000}
