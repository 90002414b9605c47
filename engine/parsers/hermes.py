"""Hermes-style JSON calls, as Qwen2.5's and Qwen3's chat templates ask for them (SGLang: `qwen25`):

<think>
reasoning (Qwen3)
</think>

I will compute it.
<tool_call>
{"name": "python", "arguments": {"code": "print(6 * 7)"}}
</tool_call>
"""

from __future__ import annotations

import json
from typing import Any

from engine.parsers.base import Malformed, MalformedCall, ToolCallText
from engine.parsers.reasoning import THINK_CLOSE, THINK_OPEN, ThinkingParser
from engine.parsers.scan import call_from_object, decode_json, tagged_blocks

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class HermesParser(ThinkingParser):
    __slots__ = ()
    name = "qwen25"
    delimiters = (OPEN_TAG, CLOSE_TAG, THINK_OPEN, THINK_CLOSE)
    call_opener = OPEN_TAG

    def split_calls(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCallText]]:
        content, bodies = tagged_blocks(text, OPEN_TAG, CLOSE_TAG)
        return content, [_call(body, number) for number, body in enumerate(bodies, 1)]

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{OPEN_TAG}\n{call}\n{CLOSE_TAG}"


def _call(body: str, number: int) -> ToolCallText:
    if not body.strip():
        raise MalformedCall(Malformed.EMPTY_CALL, f"tool call {number} is empty", number)
    return call_from_object(decode_json(body, number), number)
