"""Mistral's calls (SGLang: `mistral`): a JSON list after [TOOL_CALLS], as Mistral-7B-Instruct-v0.3's template
writes them, or each call as `[TOOL_CALLS]name[ARGS]{...}`, as the newer tokenizers (v11 on) do, the name
optionally followed by `[CALL_ID]id`:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.parsers.base import Malformed, MalformedCall, ToolCallText
from engine.parsers.reasoning import ThinkingParser
from engine.parsers.scan import NAME, call_from_object, decode_json_at, must_be_object, nameless

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_SPACE = re.compile(r"\s*")


class MistralParser(ThinkingParser):
    __slots__ = ()
    name = "mistral"
    delimiters = (TOOL_CALLS, ARGS)
    call_opener = TOOL_CALLS

    def split_calls(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCallText]]:
        content, *groups = text.split(TOOL_CALLS)
        calls: list[ToolCallText] = []
        for group in groups:
            found, tail = _group(group, len(calls) + 1)
            calls += found
            content += tail
        return content, calls

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        return f"{TOOL_CALLS} [{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}]"


def _group(group: str, number: int) -> tuple[list[ToolCallText], str]:
    """The calls in what follows one [TOOL_CALLS], and the text after them."""
    start = _SPACE.match(group).end()
    if group.startswith("[", start) and not group.startswith(ARGS, start):
        calls, end = decode_json_at(group, start, number)
        if not calls:
            raise MalformedCall(Malformed.EMPTY_CALL, f"the list of calls after {TOOL_CALLS} is empty", number)
        return [call_from_object(call, n, id_key="id") for n, call in enumerate(calls, number)], group[end:]
    head, separator, rest = group.partition(ARGS)
    if not separator:
        if not group.strip():
            raise MalformedCall(Malformed.EMPTY_CALL, f"tool call {number} is empty after {TOOL_CALLS}", number)
        detail = f"tool call {number} has no {ARGS} between its name and its arguments"
        raise MalformedCall(Malformed.NO_SEPARATOR, detail, number)
    name, _, call_id = (part.strip() for part in head.partition(CALL_ID))
    if not NAME.fullmatch(name):
        raise nameless(name, number)
    subject = f"tool call {number} ({name}) has arguments that are"
    arguments, end = decode_json_at(rest, _SPACE.match(rest).end(), number, subject, name=name)
    return [ToolCallText(name, must_be_object(arguments, number, name), call_id or None)], rest[end:]
