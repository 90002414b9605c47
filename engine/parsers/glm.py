"""GLM's calls: the name, then key/value pairs whose values are bare text decoded by the tool's schema.
GLM-4.5/4.6 (SGLang: `glm45`) put each on a line of its own; GLM-4.7 (`glm47`) writes them without newlines:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    </tool_call>

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>

Either family's parser reads both layouts; each writes its own.
"""

from __future__ import annotations

import re
from typing import Any

from engine.parsers.base import Malformed, MalformedCall, ToolCallText
from engine.parsers.hermes import CLOSE_TAG, OPEN_TAG
from engine.parsers.reasoning import THINK_CLOSE, THINK_OPEN, ThinkingParser
from engine.parsers.scan import NAME, nameless, stray, tagged_blocks
from engine.parsers.values import add_argument, as_text

KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL)


class Glm45Parser(ThinkingParser):
    __slots__ = ()
    name = "glm45"
    delimiters = (OPEN_TAG, CLOSE_TAG, KEY, KEY_END, VALUE, VALUE_END, THINK_OPEN, THINK_CLOSE)
    call_opener = OPEN_TAG
    newline = "\n"

    def split_calls(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCallText]]:
        content, bodies = tagged_blocks(text, OPEN_TAG, CLOSE_TAG)
        return content, [_call(body, number, tools) for number, body in enumerate(bodies, 1)]

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        line = self.newline
        pairs = "".join(
            f"{KEY}{key}{KEY_END}{line}{VALUE}{as_text(value)}{VALUE_END}{line}" for key, value in arguments.items()
        )
        return f"{OPEN_TAG}{name}{line}{pairs}{CLOSE_TAG}"


class Glm47Parser(Glm45Parser):
    __slots__ = ()
    name = "glm47"
    newline = ""


def _call(body: str, number: int, tools: list[dict]) -> ToolCallText:
    if not body.strip():
        raise MalformedCall(Malformed.EMPTY_CALL, f"tool call {number} is empty", number)
    head, key, pairs = body.partition(KEY)
    name, _, rest = (part.strip() for part in head.strip().partition("\n"))
    if not NAME.fullmatch(name):
        raise nameless(head.strip(), number)
    if rest:
        raise stray(rest, number, f"where {KEY}name{KEY_END}{VALUE}value{VALUE_END} belongs", name)
    return ToolCallText(name, _arguments(key + pairs, name, number, tools))


def _arguments(text: str, name: str, number: int, tools: list[dict]) -> dict[str, Any]:
    arguments: dict[str, Any] = {}
    position = 0
    while text[position:].strip():
        pair = _PAIR.match(text, position)
        if pair is None or any(tag in pair[part] for part in ("key", "value") for tag in (KEY, VALUE)):
            raise _broken(text[position:].lstrip(), name, number)
        add_argument(arguments, pair["key"].strip(), pair["value"], tools=tools, tool=name, number=number)
        position = pair.end()
    return arguments


def _broken(text: str, name: str, number: int) -> MalformedCall:
    """What is wrong where a key/value pair was due."""
    if not text.startswith(KEY):
        return stray(text, number, f"where {KEY}name{KEY_END}{VALUE}value{VALUE_END} belongs", name)
    key_end = text.find(KEY_END)
    if key_end < 0 or VALUE in text[:key_end]:
        return MalformedCall(Malformed.NO_CLOSING_TAG, f"{KEY} is never closed with {KEY_END}", number, name)
    key = text[len(KEY) : key_end].strip()
    if not text[key_end + len(KEY_END) :].lstrip().startswith(VALUE):
        detail = f"tool call {number} ({name}): the argument {key!r} has no {VALUE}...{VALUE_END} after it"
        return MalformedCall(Malformed.UNEXPECTED_TEXT, detail, number, name)
    detail = f"{VALUE} of the argument {key!r} is never closed with {VALUE_END}"
    return MalformedCall(Malformed.NO_CLOSING_TAG, detail, number, name)
