"""Llama 3.1/3.2 JSON calls (SGLang: `llama3`): a turn that is a JSON object naming a function, optionally
after <|python_tag|>, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Text after <|python_tag|>, or a turn that starts with `{"`, is read as calls; "arguments" is taken for
"parameters" too. Text after the last call is content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.parsers.base import ToolCallText
from engine.parsers.reasoning import ThinkingParser
from engine.parsers.scan import call_from_object, decode_json_at

PYTHON_TAG = "<|python_tag|>"
_CALL_START = re.compile(r'\s*\{\s*"')
_SPACE = re.compile(r"\s*")


class Llama3Parser(ThinkingParser):
    __slots__ = ()
    name = "llama3"
    delimiters = (PYTHON_TAG,)
    call_opener = PYTHON_TAG

    def split_calls(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCallText]]:
        before, tag, rest = text.partition(PYTHON_TAG)
        if not tag:
            if not _CALL_START.match(text):
                return text, []
            before, rest = "", text
        calls: list[ToolCallText] = []
        position = 0
        while True:
            number = len(calls) + 1
            value, position = decode_json_at(rest, _SPACE.match(rest, position).end(), number)
            calls.append(call_from_object(value, number, arguments=("parameters", "arguments")))
            after = _SPACE.match(rest, position).end()
            if not rest.startswith(";", after):
                return before + rest[position:], calls
            if not rest[after + 1 :].strip():  # a `;` after the last call
                return before, calls
            position = after + 1

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
