"""Qwen-style tool calls, parsed the one way every tool env shares, with one clear observation per mistake.

Qwen2.5's chat template tells the model to answer a tool with

    <tool_call>
    {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    </tool_call>

`parse_tool_calls` finds those blocks in a reply and checks each against the tools the env offers (their
arguments are pydantic models, which also give the JSON schema the prompt shows). A reply without a block
gives no calls; a malformed one raises `MalformedToolCall`, whose `kind` says what was wrong and whose
`observation` is the text to send back, so the model learns the format instead of being cut off:

    python = Tool("python", "Run Python code.", PythonArguments, example={"code": "print(1 + 1)"})
    try:
        calls = parse_tool_calls(reply, [python])          # [] or [ToolCall("python", {"code": ...})]
    except MalformedToolCall as error:
        observation = error.observation                    # "Tool call error (invalid_json): ..."

docs/envs/tool_calls.md lists every malformed call and its observation (tests/test_tool_calls.py checks each).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ValidationError

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_TAG = re.compile(r"</?tool_call>")
_CALL_KEYS = ("name", "arguments")
_TYPE_NAMES = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
}


class Malformed(StrEnum):
    """What is wrong with a tool call."""

    NO_CLOSING_TAG = "no_closing_tag"
    NO_OPENING_TAG = "no_opening_tag"
    NESTED_CALL = "nested_call"
    EMPTY_CALL = "empty_call"
    INVALID_JSON = "invalid_json"
    DUPLICATE_KEY = "duplicate_key"
    NOT_AN_OBJECT = "not_an_object"
    NO_NAME = "no_name"
    UNEXPECTED_KEY = "unexpected_key"
    UNKNOWN_TOOL = "unknown_tool"
    ARGUMENTS_NOT_AN_OBJECT = "arguments_not_an_object"
    MISSING_ARGUMENT = "missing_argument"
    UNEXPECTED_ARGUMENT = "unexpected_argument"
    WRONG_ARGUMENT_TYPE = "wrong_argument_type"
    INVALID_ARGUMENT = "invalid_argument"
    TOO_MANY_CALLS = "too_many_calls"


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool an env offers: its name, what it does, its arguments (a pydantic model; give it
    `extra="forbid"` so unknown arguments are refused) and one example call's arguments."""

    name: str
    description: str
    arguments: type[BaseModel]
    example: Mapping[str, Any] = field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`tools=[...]`, or a prompt row's `metadata["tools"]`)."""
        parameters = _without_titles(self.arguments.model_json_schema())
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    def example_call(self) -> str:
        return f"{OPEN_TAG}\n{json.dumps({'name': self.name, 'arguments': dict(self.example)})}\n{CLOSE_TAG}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One well-formed call: the tool's name and its validated arguments."""

    name: str
    arguments: dict[str, Any]


class MalformedToolCall(ValueError):
    """A reply whose tool call cannot be run: `kind` names the mistake, `detail` says where, and
    `observation` is the message for the model (the mistake and a well-formed example call)."""

    def __init__(self, kind: Malformed, detail: str, tools: Iterable[Tool] = ()):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        examples = "\n".join(tool.example_call() for tool in tools)
        hint = f"\nA well-formed call:\n{examples}" if examples else ""
        self.observation = f"Tool call error ({kind}): {detail}.{hint}"


def parse_tool_calls(text: str, tools: Iterable[Tool], *, max_calls: int | None = 1) -> list[ToolCall]:
    """The tool calls in a model's reply, in order: [] when it has none. Raises MalformedToolCall for the
    first thing wrong (tags, JSON, the tool's name, its arguments, or more than `max_calls` calls)."""
    offered = {tool.name: tool for tool in tools}
    bodies = _call_bodies(text, offered.values())
    if max_calls is not None and len(bodies) > max_calls:
        allowed = "one tool call" if max_calls == 1 else f"at most {max_calls} tool calls"
        raise MalformedToolCall(
            Malformed.TOO_MANY_CALLS,
            f"the reply makes {len(bodies)} tool calls; make {allowed} per reply",
            offered.values(),
        )
    return [_parse_call(body, number, offered) for number, body in enumerate(bodies, 1)]


def _call_bodies(text: str, tools: Iterable[Tool]) -> list[str]:
    """The text between each `<tool_call>` and its `</tool_call>`; unbalanced tags raise."""
    bodies, start = [], None
    for tag in _TAG.finditer(text):
        if tag.group() == OPEN_TAG:
            if start is not None:
                raise MalformedToolCall(
                    Malformed.NESTED_CALL,
                    f"a {OPEN_TAG} opens before the one before it is closed with {CLOSE_TAG}",
                    tools,
                )
            start = tag.end()
        elif start is None:
            raise MalformedToolCall(Malformed.NO_OPENING_TAG, f"{CLOSE_TAG} without a {OPEN_TAG} before it", tools)
        else:
            bodies.append(text[start : tag.start()])
            start = None
    if start is not None:
        raise MalformedToolCall(Malformed.NO_CLOSING_TAG, f"{OPEN_TAG} is never closed with {CLOSE_TAG}", tools)
    return bodies


def _parse_call(body: str, number: int, offered: Mapping[str, Tool]) -> ToolCall:
    tools = offered.values()
    where = f"tool call {number}"
    if not body.strip():
        raise MalformedToolCall(Malformed.EMPTY_CALL, f"{where} is empty", tools)
    call = _decode(body, where, tools)
    if not isinstance(call, dict):
        kind = _json_kind(call)
        raise MalformedToolCall(
            Malformed.NOT_AN_OBJECT, f'{where} is {kind}, not an object {{"name": ..., "arguments": ...}}', tools
        )
    if extra := sorted(set(call) - set(_CALL_KEYS)):
        keys = ", ".join(repr(key) for key in extra)
        raise MalformedToolCall(
            Malformed.UNEXPECTED_KEY, f'{where} has {keys}; a call has only "name" and "arguments"', tools
        )
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedToolCall(Malformed.NO_NAME, f'{where} has no "name" string naming the tool', tools)
    tool = offered.get(name)
    if tool is None:
        names = ", ".join(repr(known) for known in offered) or "none"
        raise MalformedToolCall(
            Malformed.UNKNOWN_TOOL, f"{where} names the tool {name!r}; the tools are {names}", tools
        )
    return ToolCall(name, _arguments(call.get("arguments"), tool, where))


def _decode(body: str, where: str, tools: Iterable[Tool]) -> Any:
    """The JSON of a call's body; duplicate keys are refused (json would keep the last one silently)."""

    def refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if duplicate := next((key for key in keys if keys.count(key) > 1), None):
            raise MalformedToolCall(Malformed.DUPLICATE_KEY, f"{where} gives the key {duplicate!r} twice", tools)
        return dict(pairs)

    try:
        return json.loads(body.strip(), object_pairs_hook=refuse_duplicates)
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(
            Malformed.INVALID_JSON,
            f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            tools,
        ) from exc


def _arguments(value: Any, tool: Tool, where: str) -> dict[str, Any]:
    """A call's arguments, validated by the tool's model. JSON text of an object is taken too, as
    OpenAI-style calls carry their arguments as a string."""
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    if not isinstance(value, dict):
        given = "no" if value is None else f"{_json_kind(value)} as its"
        raise MalformedToolCall(
            Malformed.ARGUMENTS_NOT_AN_OBJECT, f'{where} has {given} "arguments"; give an object', [tool]
        )
    try:
        return tool.arguments.model_validate(value, strict=True).model_dump()
    except ValidationError as exc:
        kind, detail = _first_problem(exc, tool)
        raise MalformedToolCall(kind, f"{where} ({tool.name}): {detail}", [tool]) from exc


def _first_problem(exc: ValidationError, tool: Tool) -> tuple[Malformed, str]:
    """The kind and text of the first thing pydantic found wrong with the arguments."""
    error = exc.errors()[0]
    argument = ".".join(str(part) for part in error["loc"]) or "arguments"
    takes = ", ".join(tool.arguments.model_fields)
    if error["type"] == "missing":
        return Malformed.MISSING_ARGUMENT, f"the argument {argument!r} is missing (it takes: {takes})"
    if error["type"] == "extra_forbidden":
        return Malformed.UNEXPECTED_ARGUMENT, f"{argument!r} is not an argument (it takes: {takes})"
    if error["type"] in _TYPE_NAMES:
        given = _json_kind(error["input"])
        return (
            Malformed.WRONG_ARGUMENT_TYPE,
            f"the argument {argument!r} must be {_TYPE_NAMES[error['type']]}, not {given}",
        )
    why = error["msg"].removeprefix("Value error, ")
    return Malformed.INVALID_ARGUMENT, f"the argument {argument!r}: {why}"


def _json_kind(value: Any) -> str:
    """What a JSON value is, in words, with a short preview."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    kind = "null" if value is None else kinds.get(type(value), type(value).__name__)
    preview = json.dumps(value, default=str)
    return f"{kind} ({preview[:40] + '...' if len(preview) > 43 else preview})"


def _without_titles(schema: Any) -> Any:
    """pydantic's JSON schema without its generated "title" keys, which the model need not read."""
    if isinstance(schema, dict):
        return {k: _without_titles(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_without_titles(item) for item in schema]
    return schema
