"""Tool calls, parsed the one way every tool env shares, in the format of the model family that runs, with one
clear observation per mistake.

The family's output parser (engine/parsers: the one `use_parser` set, Qwen2.5's by default) finds the calls in
a reply; `parse_tool_calls` then checks each against the tools the env offers (their arguments are pydantic
models, which also give the JSON schema the prompt shows). A reply without a call gives no calls; a malformed
one raises `MalformedToolCall`, whose `kind` says what was wrong and whose `observation` is the text to send
back, with an example call in the family's own format, so the model learns the format instead of being cut off:

    python = Tool("python", "Run Python code.", PythonArguments, example={"code": "print(1 + 1)"})
    try:
        calls = parse_tool_calls(reply, [python])          # [] or [ToolCall("python", {"code": ...})]
    except MalformedToolCall as error:
        observation = error.observation                    # "Tool call error (invalid_json): ..."

docs/envs/tool_calls.md lists every malformed call and its observation (tests/test_tool_calls.py checks each).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from engine.parsers import Malformed, MalformedCall, OutputParser, ToolCallText, current_parser, reasoning_open
from engine.parsers.scan import json_kind

_TYPE_NAMES = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
}


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

    def example_call(self, parser: OutputParser | None = None) -> str:
        """The example call as the family writes it (the current family's by default); "" where the parser cannot
        write one."""
        return (parser or current_parser()).format_call(self.name, dict(self.example))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One well-formed call: the tool's name and its validated arguments."""

    name: str
    arguments: dict[str, Any]


class MalformedToolCall(ValueError):
    """A reply whose tool call cannot be run: `kind` names the mistake (engine.parsers.Malformed, re-exported
    here), `detail` says where, and `observation` is the message for the model (the mistake and a well-formed
    example call in the family's format)."""

    def __init__(
        self,
        kind: Malformed,
        detail: str,
        tools: Iterable[Tool] = (),
        parser: OutputParser | None = None,
    ):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        # none where the parser cannot write a call (a turn SGLang read, of a family the engine has no parser for)
        examples = "\n".join(filter(None, (tool.example_call(parser) for tool in tools)))
        hint = f"\nA well-formed call:\n{examples}" if examples else ""
        self.observation = f"Tool call error ({kind}): {detail}.{hint}"


def parse_tool_calls(
    text: str,
    tools: Iterable[Tool],
    *,
    max_calls: int | None = 1,
    parser: OutputParser | None = None,
    in_reasoning: bool | None = None,
) -> list[ToolCall]:
    """The tool calls in a model's reply, in order: [] when it has none. `parser` is the family's (the
    current one by default); it gets the tools' schemas. `in_reasoning`: the reply starts inside its reasoning
    (by default as the engine set it for this step), whose text is no call. Raises MalformedToolCall for the
    first thing wrong (the call's syntax, the tool's name, its arguments, or more than `max_calls` calls)."""
    parser = parser or current_parser()
    in_reasoning = reasoning_open() if in_reasoning is None else in_reasoning
    offered = {tool.name: tool for tool in tools}
    schemas = [tool.schema() for tool in offered.values()]
    try:
        calls = parser.parse(text, tools=schemas, in_reasoning=in_reasoning).tool_calls
    except MalformedCall as error:
        named = [offered[error.name]] if error.name in offered else offered.values()
        raise MalformedToolCall(error.kind, error.detail, named, parser) from error
    if max_calls is not None and len(calls) > max_calls:
        allowed = "one tool call" if max_calls == 1 else f"at most {max_calls} tool calls"
        detail = f"the reply makes {len(calls)} tool calls; make {allowed} per reply"
        raise MalformedToolCall(Malformed.TOO_MANY_CALLS, detail, offered.values(), parser)
    return [_validated(call, number, offered, parser) for number, call in enumerate(calls, 1)]


def _validated(call: ToolCallText, number: int, offered: Mapping[str, Tool], parser: OutputParser) -> ToolCall:
    """The call with its arguments validated by the tool's model (strict: "3" is not an integer)."""
    where = f"tool call {number}"
    tool = offered.get(call.name)
    if tool is None:
        names = ", ".join(repr(known) for known in offered) or "none"
        detail = f"{where} names the tool {call.name!r}; the tools are {names}"
        raise MalformedToolCall(Malformed.UNKNOWN_TOOL, detail, offered.values(), parser)
    try:
        return ToolCall(call.name, tool.arguments.model_validate(call.arguments, strict=True).model_dump())
    except ValidationError as exc:
        kind, detail = _first_problem(exc, tool)
        raise MalformedToolCall(kind, f"{where} ({tool.name}): {detail}", [tool], parser) from exc


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
        given = json_kind(error["input"])
        return (
            Malformed.WRONG_ARGUMENT_TYPE,
            f"the argument {argument!r} must be {_TYPE_NAMES[error['type']]}, not {given}",
        )
    why = error["msg"].removeprefix("Value error, ")
    return Malformed.INVALID_ARGUMENT, f"the argument {argument!r}: {why}"


def _without_titles(schema: Any) -> Any:
    """pydantic's JSON schema without its generated "title" keys, which the model need not read."""
    if isinstance(schema, dict):
        return {k: _without_titles(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_without_titles(item) for item in schema]
    return schema
