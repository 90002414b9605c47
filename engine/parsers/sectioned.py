"""Calls in one section of special tokens, each a head, a separator and JSON arguments: Kimi-K2 (SGLang:
`kimi_k2`, the head an id `functions.<name>:<index>`) and DeepSeek-V3.1 (`deepseekv31`, the head the name;
its markers use fullwidth bars and U+2581):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Beijing"}<｜tool▁call▁end｜>
    <｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from typing import Any

from engine.parsers.base import Malformed, MalformedCall, ToolCallText
from engine.parsers.reasoning import THINK_CLOSE, THINK_OPEN, ThinkingParser
from engine.parsers.scan import NAME, nameless, stray, tagged_blocks, text_arguments

_KIMI_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s:.]+(?:\.[^\s:.]+)*):\d+")


class SectionedParser(ThinkingParser):
    """`section[0] (call[0] head separator {arguments} call[1])* section[1]`; subclasses read the head."""

    __slots__ = ()
    section: tuple[str, str]
    call: tuple[str, str]
    separator: str

    @property
    def delimiters(self) -> tuple[str, ...]:
        return (*self.section, *self.call, self.separator, THINK_OPEN, THINK_CLOSE)

    @property
    def call_opener(self) -> str:
        return self.section[0]  # a call opens its section

    def split_calls(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCallText]]:
        content, sections = tagged_blocks(text, *self.section)
        if any(marker in content for marker in (*self.call, self.separator)):
            detail = f"a {self.call[0]} call stands outside {self.section[0]} ... {self.section[1]}"
            raise MalformedCall(Malformed.NO_OPENING_TAG, detail, 1)
        calls: list[ToolCallText] = []
        for section in sections:
            between, bodies = tagged_blocks(section, *self.call, first=len(calls) + 1)
            if not bodies and not between.strip():
                detail = f"{self.section[0]} ... {self.section[1]} holds no call"
                raise MalformedCall(Malformed.EMPTY_CALL, detail, len(calls) + 1)
            if between.strip():
                where = f"in {self.section[0]} ... {self.section[1]}, where only {self.call[0]} calls belong"
                raise stray(between, len(calls) + 1, where)
            calls += [self._call(body, number) for number, body in enumerate(bodies, len(calls) + 1)]
        return content, calls

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        call = f"{self.head(name, index)}{self.separator}{json.dumps(arguments, ensure_ascii=False)}"
        return f"{self.section[0]}{self.call[0]}{call}{self.call[1]}{self.section[1]}"

    def _call(self, body: str, number: int) -> ToolCallText:
        if not body.strip():
            raise MalformedCall(Malformed.EMPTY_CALL, f"tool call {number} is empty", number)
        head, separator, arguments = body.partition(self.separator)
        if not separator:
            detail = f"tool call {number} has no {self.separator} between its name and its arguments"
            raise MalformedCall(Malformed.NO_SEPARATOR, detail, number)
        name, call_id = self.read_head(head.strip(), number)
        return ToolCallText(name, text_arguments(arguments, number, name), call_id)

    @abstractmethod
    def head(self, name: str, index: int) -> str:
        """What the family writes before the separator."""

    @abstractmethod
    def read_head(self, head: str, number: int) -> tuple[str, str | None]:
        """The name and id in a call's head; raises MalformedCall (no_name) where there is no name."""


class KimiK2Parser(SectionedParser):
    __slots__ = ()
    name = "kimi_k2"
    section = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    call = ("<|tool_call_begin|>", "<|tool_call_end|>")
    separator = "<|tool_call_argument_begin|>"

    def head(self, name: str, index: int) -> str:
        return f"functions.{name}:{index}"

    def read_head(self, head: str, number: int) -> tuple[str, str | None]:
        if found := _KIMI_ID.fullmatch(head):
            return found["name"], head
        detail = f"tool call {number} has the id {head[:40]!r}, not functions.<name>:<index>"
        raise MalformedCall(Malformed.NO_NAME, detail, number)


class DeepSeekV31Parser(SectionedParser):
    __slots__ = ()
    name = "deepseekv31"
    section = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    call = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
    separator = "<｜tool▁sep｜>"

    def head(self, name: str, index: int) -> str:
        return name

    def read_head(self, head: str, number: int) -> tuple[str, str | None]:
        if NAME.fullmatch(head):
            return head, None
        raise nameless(head, number)
