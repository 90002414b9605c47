"""The output parser of a family the engine has no parser for, read off its chat template: how the template writes
a structured call (engine/encoding.py's `probe_layout` renders calls with sentinel names, keys and values and
finds the literal text around each) is how the model, trained on it, writes one. A `Layout` holds that literal
text; `ProbedParser` reads a turn by it and writes calls by it.

    layout = encoder.probed_layout        # None, with encoder.probe_problem saying why, where no layout is found
    parser = ProbedParser(layout)
    parser.parse('<minimax:tool_call>\\n<invoke name="f">\\n<parameter name="x">1</parameter>\\n</invoke>\\n'
                 '</minimax:tool_call>').tool_calls                       # (ToolCallText("f", {"x": 1}),)

A turn is `[reasoning] content [section_open (call_open NAME name_close ARGUMENTS call_close)+ section_close]`:
ARGUMENTS are `(arg_open KEY arg_sep VALUE arg_close)*`, each value decoded by the tool's declared type (JSON
where it is not a string), or one JSON object (`json_arguments`). Markers are matched with their whitespace
loose (any run of whitespace, or none, where the template writes some), as models drift in whitespace.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from engine.parsers.base import Malformed, MalformedCall, ParsedTurn, ToolCallText
from engine.parsers.reasoning import split_reasoning
from engine.parsers.scan import must_be_object
from engine.parsers.values import add_argument, as_text


@dataclass(frozen=True, slots=True)
class Layout:
    """The literal text a template writes around a structured call's parts, and around the reasoning."""

    section_open: str  # before the first call ("" where each call stands alone)
    call_open: str  # before each call's name
    name_close: str  # after the name, before the arguments
    arg_open: str  # before each argument's key ("" with json_arguments)
    arg_sep: str  # between a key and its value
    arg_close: str  # after each value
    call_close: str  # after the arguments
    section_close: str  # after the last call
    json_arguments: bool = False  # the arguments are one JSON object after name_close
    reasoning_open: str = ""  # the reasoning block's markers ("" where the template writes none)
    reasoning_close: str = ""


def _loose(marker: str) -> re.Pattern[str]:
    """`marker` matched at a position, with leading whitespace skipped and each whitespace run in it optional."""
    return re.compile(r"\s*" + _unanchored(marker).pattern)


PYTHON_LITERALS = {"True": "true", "False": "false", "None": "null"}  # a template that writes `{{ value }}`


def _as_json(raw: str) -> str:
    """A value as the template writes it, Python's literals (MiniCPM5's `False`) as JSON's."""
    return PYTHON_LITERALS.get(raw, raw)


def _unanchored(marker: str) -> re.Pattern[str]:
    """`marker` searched for (not at a position), each whitespace run in it optional."""
    return re.compile(r"\s*".join(re.escape(part) for part in marker.split()))


class NoCallSyntax(ValueError):
    """Tool calls were asked of a model whose call syntax no parser knows."""


@dataclass(frozen=True)
class NoCallsParser:
    """A model's turns where no parser knows how it writes a tool call (no family the engine has, and none read
    off its template): its reasoning split off by the template's own markers, the rest its content. Asking it for
    calls, or to write one, is one error naming why none can be read, never a guess at another family's syntax."""

    problem: str  # why no call syntax was found (the probe's word)
    reasoning_open: str = ""
    reasoning_close: str = ""
    name = "none"

    @property
    def delimiters(self) -> tuple[str, ...]:
        return (self.reasoning_close.strip(),) if self.reasoning_close.strip() else ()

    def parse(self, text: str, *, tools: list[dict] | None = None, in_reasoning: bool = False) -> ParsedTurn:
        if tools:
            raise self.refused()
        reasoning, rest = split_reasoning(
            text, in_reasoning=in_reasoning, opener=self.reasoning_open, closer=self.reasoning_close
        )
        return ParsedTurn(rest.strip(), reasoning)

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        raise self.refused()

    def refused(self) -> NoCallSyntax:
        return NoCallSyntax(
            f"this model's tool calls cannot be read: {self.problem}; name its family with model_family (SGLang's "
            "--tool-call-parser name), and SGLang reads the turns where the engine has no parser for it"
        )


class ProbedParser:
    """Reads and writes turns by a `Layout` found in the template (see the module docstring)."""

    name = "probed"

    def __init__(self, layout: Layout):
        self.layout = layout

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProbedParser) and other.layout == self.layout

    def __hash__(self) -> int:
        return hash(self.layout)

    def __reduce__(self) -> tuple[Any, ...]:
        return ProbedParser, (self.layout,)

    @property
    def delimiters(self) -> tuple[str, ...]:
        first = self.layout.section_open or self.layout.call_open
        return tuple(m.strip() for m in (first, self.layout.reasoning_close) if m.strip())

    @cached_property
    def _start(self) -> re.Pattern[str]:
        """Where the calls start: the section's opening and the first call's, loosely."""
        return _unanchored(self.layout.section_open + self.layout.call_open)

    def parse(self, text: str, *, tools: list[dict] | None = None, in_reasoning: bool = False) -> ParsedTurn:
        reasoning, rest = self._split_reasoning(text, in_reasoning)
        found = self._start.search(rest)
        if found is None:
            return ParsedTurn(rest.strip(), reasoning)
        return ParsedTurn(rest[: found.start()].strip(), reasoning, self._calls(rest, found.start(), tools or []))

    def _split_reasoning(self, text: str, in_reasoning: bool) -> tuple[str, str]:
        layout = self.layout
        return split_reasoning(
            text, in_reasoning=in_reasoning, opener=layout.reasoning_open, closer=layout.reasoning_close
        )

    def _calls(self, text: str, start: int, tools: list[dict]) -> tuple[ToolCallText, ...]:
        layout, at, calls = self.layout, start, []
        if layout.section_open.strip():
            at = self._expect(text, at, layout.section_open, len(calls) + 1, "the calls' opening")
        while True:
            number = len(calls) + 1
            at = self._expect(text, at, layout.call_open, number, "a call's opening")
            name, at = self._name(text, at, number)
            if not name.strip():
                raise MalformedCall(Malformed.NO_NAME, f"tool call {number} has no tool name", number)
            name = name.strip()
            arguments, at = self._arguments(text, at, number, name, tools)
            at = self._expect(text, at, layout.call_close, number, "the call's end", name)
            calls.append(ToolCallText(name, arguments))
            if _loose(layout.call_open).match(text, at) is None:
                break
        if layout.section_close.strip():
            at = self._expect(text, at, layout.section_close, len(calls), "the calls' end")
        if text[at:].strip():
            detail = f"text after tool call {len(calls)}: {text[at:].strip()[:40]!r}"
            raise MalformedCall(Malformed.UNEXPECTED_TEXT, detail, len(calls))
        return tuple(calls)

    def _arguments(self, text: str, at: int, number: int, name: str, tools: list[dict]) -> tuple[dict[str, Any], int]:
        layout = self.layout
        if layout.json_arguments:
            at += len(text[at:]) - len(text[at:].lstrip())
            try:
                value, end = json.JSONDecoder().raw_decode(text, at)
            except json.JSONDecodeError as exc:
                detail = f"tool call {number} ({name}): its arguments are not JSON: {exc.msg}"
                raise MalformedCall(Malformed.INVALID_JSON, detail, number, name) from None
            return must_be_object(value, number, name), end
        arguments: dict[str, Any] = {}
        opener = _loose(layout.arg_open)
        while (found := opener.match(text, at)) is not None and layout.arg_open.strip():
            key, at = self._until(text, found.end(), layout.arg_sep, number, "an argument's name", name)
            raw, at = self._until(text, at, layout.arg_close, number, f"the value of {key.strip()!r}", name)
            add_argument(arguments, key.strip(), _as_json(raw.strip()), tools=tools, tool=name, number=number)
        return arguments, at

    def _name(self, text: str, at: int, number: int) -> tuple[str, int]:
        """The tool's name: up to the marker after it, or, where the template writes none (GLM's `<tool_call>NAME
        <arg_key>`), up to the first argument's opening or the call's end, which are left to read."""
        layout = self.layout
        if layout.name_close.strip():
            return self._until(text, at, layout.name_close, number, "the tool's name")
        markers = [marker for marker in (layout.arg_open, layout.call_close) if marker.strip()]
        found = [end.start() for marker in markers if (end := _unanchored(marker).search(text, at)) is not None]
        if not found:
            detail = f"tool call {number}: the tool's name is not followed by its arguments or the call's end"
            raise MalformedCall(Malformed.NO_CLOSING_TAG, detail, number)
        return text[at : min(found)], min(found)

    @staticmethod
    def _expect(text: str, at: int, marker: str, number: int, what: str, name: str | None = None) -> int:
        if not marker.strip():
            return at
        found = _loose(marker).match(text, at)
        if found is None:
            detail = f"tool call {number}: expected {marker.strip()!r} ({what}), found {text[at : at + 40].strip()!r}"
            raise MalformedCall(Malformed.UNEXPECTED_TEXT, detail, number, name)
        return found.end()

    @staticmethod
    def _until(text: str, at: int, marker: str, number: int, what: str, name: str | None = None) -> tuple[str, int]:
        """The text from `at` to `marker` (matched loosely), and the position after it."""
        found = _unanchored(marker).search(text, at) if marker.strip() else None
        if found is None:
            detail = f"tool call {number}: {what} is not closed by {marker.strip()!r}"
            raise MalformedCall(Malformed.NO_CLOSING_TAG, detail, number, name)
        return text[at : found.start()], found.end()

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        """One call as the template writes it."""
        layout = self.layout
        if layout.json_arguments:
            body = json.dumps(arguments, ensure_ascii=False)
        else:
            body = "".join(
                f"{layout.arg_open}{key}{layout.arg_sep}{as_text(value)}{layout.arg_close}"
                for key, value in arguments.items()
            )
        call = f"{layout.call_open}{name}{layout.name_close}{body}{layout.call_close}"
        return f"{layout.section_open}{call}{layout.section_close}"
