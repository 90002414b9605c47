"""OpenAI's harmony format, as gpt-oss writes a turn (SGLang: `gpt-oss`): messages in channels, reasoning in
`analysis`, the answer in `final`, a call a `commentary` message addressed `to=functions.<name>`:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}<|call|>

The recipient may stand in the role header instead (`<|start|>assistant to=functions.x<|channel|>...`), and a
turn may end without its closing token, as the stop token (<|call|>, <|return|>) is stripped. The channels
say what is reasoning, so `in_reasoning` changes nothing here; a turn without harmony's markers is content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.parsers.base import Malformed, MalformedCall, ParsedTurn, ToolCallText
from engine.parsers.scan import text_arguments

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_MESSAGES = re.compile(r"<\|(?:end|call|return)\|>|(?=<\|start\|>)")  # where one message ends
_RECIPIENT = re.compile(r"\bto=([^\s<]*)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w*)")


class HarmonyParser:
    __slots__ = ()
    name = "gpt-oss"
    delimiters = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)

    def parse(self, text: str, *, tools: list[dict] | None = None, in_reasoning: bool = False) -> ParsedTurn:
        if not any(marker in text for marker in (START, CHANNEL, MESSAGE)):
            return ParsedTurn(text.strip())
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCallText] = []
        for part in _MESSAGES.split(text):
            is_header = part.startswith(START) or CHANNEL in part
            header, has_body, body = part.removeprefix(START).partition(MESSAGE)
            recipient = _RECIPIENT.search(header) if is_header else None
            channel = _CHANNEL.search(header)
            if not has_body:
                if recipient:  # a call cut short in its header
                    detail = f"the header {part.strip()[:60]!r} of tool call {len(calls) + 1} never reaches {MESSAGE}"
                    raise MalformedCall(Malformed.NO_CLOSING_TAG, detail, len(calls) + 1)
                if not is_header:  # text between messages; any other header cut short holds nothing
                    content.append(part)
            elif recipient:
                calls.append(_call(recipient[1], body, len(calls) + 1))
            elif channel and channel[1] == "analysis":
                reasoning.append(body)
            elif channel and channel[1] in ("commentary", "final"):
                content.append(body)  # the answer, or a preamble to the user before a call
            else:
                name = repr(channel[1]) if channel else "no channel"
                detail = f"a message in {name}; harmony's channels are analysis, commentary and final"
                raise MalformedCall(Malformed.UNKNOWN_CHANNEL, detail, len(calls) + 1)
        return ParsedTurn(_joined(content), _joined(reasoning), tuple(calls))

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        arguments_json = json.dumps(arguments, ensure_ascii=False)
        return f"{START}assistant{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{arguments_json}{CALL}"


def _call(recipient: str, body: str, number: int) -> ToolCallText:
    name = recipient.removeprefix("functions.")
    if not name:
        detail = f"tool call {number} is addressed to {recipient!r}, which names no tool (to=functions.<name>)"
        raise MalformedCall(Malformed.NO_NAME, detail, number)
    return ToolCallText(name, text_arguments(body, number, name))


def _joined(parts: list[str]) -> str:
    return "\n".join(stripped for part in parts if (stripped := part.strip()))
