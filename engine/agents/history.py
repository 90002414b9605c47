"""Does an agent's request continue a session's conversation? Its messages are compared with the session's
messages so far, one by one, as chat messages (never as re-tokenized text): the same role, the same content
(text, or the same parts), the same tool calls (id, name, arguments as JSON values) and the same answered call.
What clients add or drop on their way back (`refusal: null`, `annotations: []`, the reasoning they were given,
content `null` against `""`) does not count.

    fit = continues(history, request_messages)
    fit.new        # the messages past the history (the observation), when they extend it with no assistant message
    fit.cause      # else why not: a fork cause (ForkCause)
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ForkCause(StrEnum):
    """Why a request starts a new chain of its session instead of continuing one."""

    EDITED = "edited"  # a message the session had is not the same (compaction, a rewritten system prompt)
    SHORTER = "shorter"  # the request ends before the session's last reply (dropped history, a sub-agent)
    WRITTEN_REPLY = "written_reply"  # its new messages hold an assistant message the model did not sample
    TOOLS_CHANGED = "tools_changed"  # the tools offered differ from the chain's
    ENDED = "ended"  # the chain it continues has ended (length, budget, failure)
    CONCURRENT = "concurrent"  # the chain it continues is busy with another request (a sub-agent's)


@dataclass(frozen=True, slots=True)
class Fit:
    """How a request's messages relate to a chain's: `new` (non-empty) when they continue it, else `cause`."""

    new: list[dict[str, Any]] | None = None
    cause: ForkCause | None = None
    repeat: bool = False  # the request is the chain's last one again (a client's retry): its reply stands


def continues(history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> Fit:
    """Whether `messages` are `history` followed by new messages that are no assistant's (the observation)."""
    if any(key(had) != key(sent) for had, sent in zip(history, messages, strict=False)):
        return Fit(cause=ForkCause.EDITED)
    if len(messages) <= len(history):
        return Fit(cause=ForkCause.SHORTER)
    new = messages[len(history) :]
    if any(message.get("role") == "assistant" for message in new):
        return Fit(cause=ForkCause.WRITTEN_REPLY)
    return Fit(new=list(new))


def unanswerable(messages: list[dict[str, Any]]) -> str | None:
    """The call id of the first tool result that answers no call an assistant message before it made, else None
    (each API refuses such a conversation; a template would render the result as if a call had been made)."""
    made: set[Any] = set()
    for message in messages:
        if message.get("role") == "assistant":
            made.update(call.get("id") for call in message.get("tool_calls") or () if isinstance(call, dict))
        elif message.get("role") == "tool" and message.get("tool_call_id") not in made:
            return str(message.get("tool_call_id"))
    return None


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether two conversations are the same messages."""
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b, strict=True))


def key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two chat messages the same message for a session."""
    role = "system" if message.get("role") == "developer" else message.get("role")
    calls = tuple(_call_key(call) for call in message.get("tool_calls") or ())
    answered = message.get("tool_call_id") if role == "tool" else None
    return role, _content_key(message.get("content")), calls, answered


def _content_key(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(("text", part.get("text", "")))
        elif isinstance(part, dict):
            parts.append((part.get("type"), json.dumps(part, sort_keys=True, default=str)))
        else:
            parts.append(("?", repr(part)))
    if all(kind == "text" for kind, _ in parts):  # text parts are their text: "a" == [{"type": "text", ...}]
        return "".join(text for _, text in parts)
    return tuple(parts)


def _call_key(call: Any) -> tuple[Any, ...]:
    function = call.get("function") or {} if isinstance(call, dict) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: compared as the text it is
            arguments = json.loads(arguments)
    return call.get("id"), function.get("name"), json.dumps(arguments, sort_keys=True, ensure_ascii=False)
