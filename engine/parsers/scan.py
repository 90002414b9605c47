"""What the formats share: marker-delimited blocks, strict JSON (a repeated key is refused, as json would
keep the last one silently) and JSON call objects `{"name": ..., "arguments": {...}}`."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from engine.parsers.base import Malformed, MalformedCall, ToolCallText

NAME = re.compile(r"[^\s<>{}\[\]\"'|]+")  # what a tool's name can be where the format writes it bare


def tagged_blocks(text: str, opener: str, closer: str, *, first: int = 1) -> tuple[str, list[str]]:
    """The text outside `opener ... closer` blocks, joined, and each block's inside, in order. Raises for an
    opener inside an open block, a closer without an opener, or an opener never closed (numbering the
    blocks from `first`)."""
    outside, bodies, start, last = [], [], None, 0
    for tag in re.finditer(f"{re.escape(opener)}|{re.escape(closer)}", text):
        number = first + len(bodies)
        if tag.group() == opener:
            if start is not None:
                detail = f"a {opener} opens before the one before it is closed with {closer}"
                raise MalformedCall(Malformed.NESTED_CALL, detail, number)
            outside.append(text[last : tag.start()])
            start = tag.end()
        elif start is None:
            raise MalformedCall(Malformed.NO_OPENING_TAG, f"{closer} without a {opener} before it", number)
        else:
            bodies.append(text[start : tag.start()])
            start, last = None, tag.end()
    if start is not None:
        raise MalformedCall(Malformed.NO_CLOSING_TAG, f"{opener} is never closed with {closer}", first + len(bodies))
    outside.append(text[last:])
    return "".join(outside), bodies


def decode_json(raw: str, number: int, subject: str = "", *, name: str | None = None) -> Any:
    """`raw` as JSON; `subject` starts the sentence saying it is not (default "tool call <number> is")."""
    with _json_errors(number, subject, name):
        return json.loads(raw.strip(), object_pairs_hook=_refusing_duplicates(number, name))


def decode_json_at(
    text: str, start: int, number: int, subject: str = "", *, name: str | None = None
) -> tuple[Any, int]:
    """The JSON value that starts at `text[start]`, and where it ends."""
    with _json_errors(number, subject, name):
        return json.JSONDecoder(object_pairs_hook=_refusing_duplicates(number, name)).raw_decode(text, start)


@contextlib.contextmanager
def _json_errors(number: int, subject: str, name: str | None) -> Iterator[None]:
    try:
        yield
    except json.JSONDecodeError as exc:
        subject = subject or f"tool call {number} is"
        detail = f"{subject} not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        raise MalformedCall(Malformed.INVALID_JSON, detail, number, name) from exc


def _refusing_duplicates(number: int, name: str | None) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if duplicate := next((key for key in keys if keys.count(key) > 1), None):
            detail = f"tool call {number} gives the key {duplicate!r} twice"
            raise MalformedCall(Malformed.DUPLICATE_KEY, detail, number, name)
        return dict(pairs)

    return build


def call_from_object(
    value: Any, number: int, *, arguments: tuple[str, ...] = ("arguments",), id_key: str | None = None
) -> ToolCallText:
    """A call written as one JSON object: "name", its arguments under one of `arguments` (an object, or
    JSON text of one, as OpenAI-style calls carry them), and an optional `id_key`; no other keys."""
    where = f"tool call {number}"
    if not isinstance(value, dict):
        shape = f'{{"name": ..., "{arguments[0]}": ...}}'
        raise MalformedCall(Malformed.NOT_AN_OBJECT, f"{where} is {json_kind(value)}, not an object {shape}", number)
    shown = [f'"{key}"' for key in ("name", arguments[0], id_key) if key]
    given = [key for key in arguments if key in value]  # "parameters" or "arguments" for Llama, not both
    if extra := sorted(set(value) - {"name", *arguments, id_key}) + given[1:]:
        keys = ", ".join(repr(key) for key in extra)
        only = f"{', '.join(shown[:-1])} and {shown[-1]}"
        raise MalformedCall(Malformed.UNEXPECTED_KEY, f"{where} has {keys}; a call has only {only}", number)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedCall(Malformed.NO_NAME, f'{where} has no "name" string naming the tool', number)
    key = given[0] if given else arguments[0]
    call_id = value.get(id_key) if id_key else None
    arguments_object = object_arguments(value.get(key), number, name, key)
    return ToolCallText(name, arguments_object, None if call_id is None else str(call_id))


def object_arguments(value: Any, number: int, name: str, key: str = "arguments") -> dict[str, Any]:
    """A call's arguments given as a JSON value: an object, or JSON text of one."""
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    if not isinstance(value, dict):
        given = "no" if value is None else f"{json_kind(value)} as its"
        detail = f'tool call {number} has {given} "{key}"; give an object'
        raise MalformedCall(Malformed.ARGUMENTS_NOT_AN_OBJECT, detail, number, name)
    return value


def text_arguments(raw: str, number: int, name: str) -> dict[str, Any]:
    """A call's arguments written as JSON text after its name (Kimi-K2, DeepSeek, harmony, Mistral)."""
    where = f"tool call {number} ({name})"
    if not raw.strip():
        detail = f"{where} has no arguments; give an object ({{}} for none)"
        raise MalformedCall(Malformed.ARGUMENTS_NOT_AN_OBJECT, detail, number, name)
    return must_be_object(decode_json(raw, number, f"{where} has arguments that are", name=name), number, name)


def must_be_object(value: Any, number: int, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        detail = f"tool call {number} ({name}) has {json_kind(value)} as its arguments; give an object"
        raise MalformedCall(Malformed.ARGUMENTS_NOT_AN_OBJECT, detail, number, name)
    return value


def json_kind(value: Any) -> str:
    """What a JSON value is, in words, with a short preview."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    kind = "null" if value is None else kinds.get(type(value), type(value).__name__)
    preview = json.dumps(value, default=str)
    return f"{kind} ({preview[:40] + '...' if len(preview) > 43 else preview})"


def stray(text: str, number: int, where: str, name: str | None = None) -> MalformedCall:
    """The error for text the format has no place for, quoting its start."""
    text = text.strip()
    quoted = repr(text[:40] + "..." if len(text) > 43 else text)
    return MalformedCall(Malformed.UNEXPECTED_TEXT, f"tool call {number} has {quoted} {where}", number, name)


def nameless(head: str, number: int) -> MalformedCall:
    """The error for a call whose head is not a tool's name."""
    start = f"starts with {head[:40]!r}, not" if head else "does not start with"
    return MalformedCall(Malformed.NO_NAME, f"tool call {number} {start} the tool's name", number)
