"""What an output parser gives and how it fails: one model turn's text as content, reasoning and tool calls,
or a `MalformedCall` naming the first syntax mistake."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ToolCallText:
    """One call as the model wrote it: the tool's name and its decoded (not yet validated) arguments; `id`
    where the format writes one (Kimi-K2's `functions.name:0`, a Mistral call id)."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """A model turn split in three: the text for the reader, the reasoning, and the calls in order."""

    content: str
    reasoning: str = ""
    tool_calls: tuple[ToolCallText, ...] = ()


class Malformed(StrEnum):
    """What is wrong with a tool call: a syntax mistake, which the family's parser finds (the first group), or
    what the tools judge (the second: `engine.envs.tool_calls.parse_tool_calls` finds those)."""

    NO_CLOSING_TAG = "no_closing_tag"
    NO_OPENING_TAG = "no_opening_tag"
    NESTED_CALL = "nested_call"
    EMPTY_CALL = "empty_call"
    INVALID_JSON = "invalid_json"
    DUPLICATE_KEY = "duplicate_key"
    NOT_AN_OBJECT = "not_an_object"
    NO_NAME = "no_name"
    UNEXPECTED_KEY = "unexpected_key"
    ARGUMENTS_NOT_AN_OBJECT = "arguments_not_an_object"
    NO_SEPARATOR = "no_separator"  # a name without the marker that leads to its arguments
    UNEXPECTED_TEXT = "unexpected_text"  # text inside a call or section that the format has no place for
    INVALID_VALUE = "invalid_value"  # an XML-valued argument its declared type cannot decode
    UNKNOWN_CHANNEL = "unknown_channel"  # a harmony message in no channel it knows

    UNKNOWN_TOOL = "unknown_tool"
    MISSING_ARGUMENT = "missing_argument"
    UNEXPECTED_ARGUMENT = "unexpected_argument"
    WRONG_ARGUMENT_TYPE = "wrong_argument_type"
    INVALID_ARGUMENT = "invalid_argument"
    TOO_MANY_CALLS = "too_many_calls"


class MalformedCall(ValueError):
    """The first thing wrong with a turn's tool calls: `kind`, `detail` (a sentence for the model), `number`
    (the call's 1-based index) and `name` (the tool named, where the mistake came after the name)."""

    def __init__(self, kind: Malformed, detail: str, number: int, name: str | None = None):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.number = number
        self.name = name


class OutputParser(Protocol):
    """One model family's turn format, named as SGLang's `--tool-call-parser` names it:

        parser = get_parser("glm45")
        turn = parser.parse(text, tools=[tool.schema()], in_reasoning=True)   # raises MalformedCall
        turn.tool_calls     # (ToolCallText("get_weather", {"city": "Beijing"}),)
        parser.format_call("get_weather", {"city": "Beijing"})                # one call as GLM writes it

    `delimiters` are the literal markers the format depends on, so a caller can check that decoding with
    skip_special_tokens keeps them. `in_reasoning` says the prompt already opened a reasoning block.
    `tools` are OpenAI-style tool schemas; formats whose argument values are bare text decode each value by
    its declared JSON-schema type. `parse(format_call(name, arguments))` gives that one call back."""

    name: str
    delimiters: tuple[str, ...]

    def parse(self, text: str, *, tools: list[dict] | None = None, in_reasoning: bool = False) -> ParsedTurn: ...

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str: ...
