"""Does an agent's request continue a session's conversation? Its messages are compared with the session's
messages so far, one by one, as chat messages (never as re-tokenized text), through a `key` per message: the
same role, the same content (text, or the same parts; an image by a digest of its data), the same tool calls
(id, name, arguments as JSON values) and the same answered call. What clients add or drop on their way back
(`refusal: null`, `annotations: []`, the reasoning they were given, content `null` against `""`), or how they
write a number back (JavaScript's `3` for `3.0`, an integer past 2**53 rounded) does not count.

    keys = [key(m) for m in request_messages]
    fit = continues(history_keys, keys)
    fit.new        # how many messages past the history (the observation), when they extend it with no
                   # assistant message
    fit.cause      # else why not: a fork cause (ForkCause)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

Key = tuple[Any, ...]  # what makes a chat message the same message for a session


class ForkCause(StrEnum):
    """Why a request starts a new chain of its session instead of continuing one."""

    EDITED = "edited"  # a message the session had is not the same (compaction, a rewritten system prompt)
    SHORTER = "shorter"  # the request ends before the session's last reply (dropped history, a sub-agent)
    WRITTEN_REPLY = "written_reply"  # its new messages hold an assistant message the model did not sample
    TOOLS_CHANGED = "tools_changed"  # the tools offered differ from the chain's
    ENDED = "ended"  # the chain it continues has ended (length, budget, failure)
    CONCURRENT = "concurrent"  # the chain it continues is busy with another request (a sub-agent's)
    AGAIN = "again"  # the request repeats one answered already, not as a retry: another sample (best-of-n)


@dataclass(frozen=True, slots=True)
class Fit:
    """How a request's messages relate to a chain's: `new` (the count of messages past the chain's history,
    at least 1) when they continue it, else `cause`; `repeat` when the request is one the chain is answering or
    has answered, asked again as a retry (its reply stands)."""

    new: int | None = None
    cause: ForkCause | None = None
    repeat: bool = False


def continues(history: list[Key], keys: list[Key]) -> Fit:
    """Whether `keys` are `history` followed by new messages that are no assistant's (the observation)."""
    if any(had != sent for had, sent in zip(history, keys, strict=False)):
        return Fit(cause=ForkCause.EDITED)
    if len(keys) <= len(history):
        return Fit(cause=ForkCause.SHORTER)
    if any(key[0] == "assistant" for key in keys[len(history) :]):
        return Fit(cause=ForkCause.WRITTEN_REPLY)
    return Fit(new=len(keys) - len(history))


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


def key(message: dict[str, Any]) -> Key:
    """What makes two chat messages the same message for a session."""
    role = "system" if message.get("role") == "developer" else message.get("role")
    calls = tuple(_call_key(call) for call in message.get("tool_calls") or ())
    answered = message.get("tool_call_id") if role == "tool" else None
    return role, _content_key(message.get("content")), calls, answered


def digest(value: Any) -> str:
    """A short digest of a JSON value (its keys sorted), or of a string as it is."""
    data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else _canonical_bytes(value)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _content_key(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(("text", part.get("text", "")))
        elif isinstance(part, dict) and part.get("type") == "image":
            parts.append(("image", digest(str(part.get("image")))))  # the data once, never serialized
        else:
            parts.append((part.get("type") if isinstance(part, dict) else "?", digest(part)))
    if all(kind == "text" for kind, _ in parts):  # text parts are their text: "a" == [{"type": "text", ...}]
        return "".join(str(text) for _, text in parts)
    return tuple(parts)


def _call_key(call: Any) -> Key:
    function = call.get("function") or {} if isinstance(call, dict) else {}
    if not isinstance(function, dict):
        return (repr(call),)
    return call.get("id"), function.get("name"), arguments_key(function.get("arguments"))


def arguments_key(arguments: Any) -> str:
    """A call's arguments as JSON values, every number as the double JavaScript would read it (`3` and `3.0`
    the same, integers past 2**53 rounded): a client that parses and re-serializes them echoes the same call.
    Arguments that are not JSON are compared as the text they are."""
    text = arguments if isinstance(arguments, str) else _canonical_bytes(arguments).decode()
    try:
        value = json.loads(text, parse_int=float)
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (ValueError, RecursionError, OverflowError):
        return text


def _canonical_bytes(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # nested past orjson's depth, or not JSON at all
        return repr(value).encode("utf-8", "surrogatepass")
