"""Argument values written as bare text (Qwen3-Coder's `<parameter=k>`, GLM's `<arg_value>`), decoded by the
type the tool's JSON schema declares: a string stays the text as written; integer, number, boolean, object
and array values are JSON. Without a declared type a value that parses as JSON is decoded, else kept."""

from __future__ import annotations

import json
from typing import Any

from engine.parsers.base import Malformed, MalformedCall

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def declared_types(tools: list[dict], tool: str, argument: str) -> frozenset[str]:
    """The JSON types the schema of `tool` allows for `argument` (`type`, a list of them, `anyOf`/`oneOf`
    branches, an `enum`'s values); empty when it declares none."""
    for schema in tools:
        function = schema.get("function", schema)
        if function.get("name") == tool:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return _types(properties.get(argument))
    return frozenset()


def _types(schema: Any) -> frozenset[str]:
    if not isinstance(schema, dict):
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list):
        return frozenset(declared)
    branches = schema.get("anyOf") or schema.get("oneOf") or []
    if branches and all(branch_types := [_types(branch) for branch in branches]):
        return frozenset().union(*branch_types)
    if isinstance(schema.get("enum"), list):
        return frozenset(_json_type(value) for value in schema["enum"])
    return frozenset()


def decode_value(raw: str, types: frozenset[str], *, number: int, tool: str, argument: str) -> Any:
    """`raw` as a value of one of `types`; raises MalformedCall when only a non-string type fits and `raw`
    is not its JSON."""
    if types and types <= {"string", "null"}:
        return None if "null" in types and raw.strip() == "null" else raw
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        if not types or "string" in types:
            return raw
        wanted = " or ".join(sorted(types))
        detail = f"tool call {number} ({tool}): the argument {argument!r} must be {wanted} (JSON), not {raw[:40]!r}"
        raise MalformedCall(Malformed.INVALID_VALUE, detail, number, tool) from None
    if "string" in types and not _fits(value, types):
        return raw
    return value


def _fits(value: Any, types: frozenset[str]) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _json_type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), "string")


def add_argument(arguments: dict[str, Any], key: str, raw: str, *, tools: list[dict], tool: str, number: int) -> None:
    """Decode one bare-text argument into `arguments`, refusing a nameless or repeated one."""
    if not key:
        detail = f"tool call {number} ({tool}) has an argument without a name"
        raise MalformedCall(Malformed.UNEXPECTED_TEXT, detail, number, tool)
    if key in arguments:
        raise MalformedCall(Malformed.DUPLICATE_KEY, f"tool call {number} gives the key {key!r} twice", number, tool)
    arguments[key] = decode_value(raw, declared_types(tools, tool, key), number=number, tool=tool, argument=key)


def as_text(value: Any) -> str:
    """A value as a bare-text format writes it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
