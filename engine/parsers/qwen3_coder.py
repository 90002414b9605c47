"""Qwen3-Coder's XML calls (SGLang: `qwen3_coder`), each argument's value bare text decoded by its schema:

<tool_call>
<function=get_weather>
<parameter=city>
Beijing
</parameter>
</function>
</tool_call>
"""

from __future__ import annotations

import re
from typing import Any

from engine.parsers.base import Malformed, MalformedCall, ToolCallText
from engine.parsers.hermes import CLOSE_TAG, OPEN_TAG
from engine.parsers.reasoning import THINK_CLOSE, THINK_OPEN, ThinkingParser
from engine.parsers.scan import stray, tagged_blocks
from engine.parsers.values import add_argument, as_text

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_FUNCTION = re.compile(r"(?P<before>.*?)<function=(?P<name>[^>]*)>(?P<body>.*?)(?P<end></function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>]*)>")


class Qwen3CoderParser(ThinkingParser):
    __slots__ = ()
    name = "qwen3_coder"
    delimiters = (OPEN_TAG, CLOSE_TAG, FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END, THINK_OPEN, THINK_CLOSE)
    call_opener = OPEN_TAG

    def split_calls(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCallText]]:
        content, bodies = tagged_blocks(text, OPEN_TAG, CLOSE_TAG)
        if FUNCTION in content:
            detail = f"a {FUNCTION}...> stands outside {OPEN_TAG} ... {CLOSE_TAG}"
            raise MalformedCall(Malformed.NO_OPENING_TAG, detail, len(bodies) + 1)
        return content, [_call(body, number, tools) for number, body in enumerate(bodies, 1)]

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        parameters = "".join(
            f"{PARAMETER}{key}>\n{as_text(value)}\n{PARAMETER_END}\n" for key, value in arguments.items()
        )
        return f"{OPEN_TAG}\n{FUNCTION}{name}>\n{parameters}{FUNCTION_END}\n{CLOSE_TAG}"


def _call(body: str, number: int, tools: list[dict]) -> ToolCallText:
    if not body.strip():
        raise MalformedCall(Malformed.EMPTY_CALL, f"tool call {number} is empty", number)
    function = _FUNCTION.match(body)
    if function is None:
        raise stray(body, number, f"where {FUNCTION}name> ... {FUNCTION_END} belongs")
    name = function["name"].strip()
    if not name:
        raise MalformedCall(Malformed.NO_NAME, f"tool call {number} has no name after {FUNCTION}", number)
    if not function["end"]:
        raise MalformedCall(Malformed.NO_CLOSING_TAG, f"{FUNCTION}{name}> is never closed with {FUNCTION_END}", number)
    if extra := function["before"].strip() or body[function.end() :].strip():
        raise stray(extra, number, f"outside {FUNCTION}{name}> ... {FUNCTION_END}", name)
    return ToolCallText(name, _arguments(function["body"], name, number, tools))


def _arguments(text: str, name: str, number: int, tools: list[dict]) -> dict[str, Any]:
    arguments: dict[str, Any] = {}
    position = 0
    while text[position:].strip():
        parameter = _PARAMETER.match(text, position)
        if parameter is None:
            raise stray(text[position:], number, f"outside {PARAMETER}name> ... {PARAMETER_END}", name)
        end = text.find(PARAMETER_END, parameter.end())
        if end < 0 or PARAMETER in text[parameter.end() : end]:
            detail = f"{PARAMETER}{parameter[1]}> is never closed with {PARAMETER_END}"
            raise MalformedCall(Malformed.NO_CLOSING_TAG, detail, number, name)
        value = text[parameter.end() : end].removeprefix("\n").removesuffix("\n")
        add_argument(arguments, parameter[1].strip(), value, tools=tools, tool=name, number=number)
        position = end + len(PARAMETER_END)
    return arguments
