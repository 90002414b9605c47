"""Anthropic Messages, as the gateway speaks it (what Claude Code and the `anthropic` SDK send): the request read
and turned into the chat messages a template takes, the model's turn as a `Message` or as the stream of events
the SDK parses, built with the official SDK's own types.

    system + messages          ->  system, user, assistant (content, reasoning_content, tool_calls), tool, ...
    tool_result blocks         ->  tool messages (`tool_call_id` = tool_use_id), before the user's text
    thinking / tool_use blocks ->  the assistant's reasoning_content / tool_calls

Sampling fields (temperature, top_p, top_k) follow the rollout's settings, as for Chat Completions.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from anthropic.types import (
    Message,
    MessageDeltaUsage,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from anthropic.types.raw_message_delta_event import Delta
from pydantic import BaseModel, ConfigDict, Field

from engine.agents.request import RequestError, check_policy_rules, validated

IGNORED = ("temperature", "top_p", "top_k")
SIGNATURE = "turnstile"  # thinking blocks carry a signature; the gateway's is constant (nothing to verify)


class MessagesRequest(BaseModel):
    """The fields of a Messages request the gateway reads; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @property
    def turn_cap(self) -> int:
        return self.max_tokens

    def sampling_asked(self) -> list[str]:
        return [name for name in IGNORED if getattr(self, name) is not None]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in the shape chat templates take."""
        if not self.tools:
            return None
        return [
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description", ""),
                    "parameters": tool.get("input_schema", {"type": "object"}),
                },
            }
            for tool in self.tools
        ]

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages; RequestError for a block it cannot take."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            role, content = message.get("role"), message.get("content")
            where = f"messages.{i}"
            if role not in ("user", "assistant"):
                raise RequestError(f"{where}.role is {role!r}; 'user' or 'assistant'", param=f"{where}.role")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(blocks, list):
                raise RequestError(f"{where}.content is neither text nor a list of blocks", param=f"{where}.content")
            out += _assistant(blocks, where) if role == "assistant" else _user(blocks, where)
        return out


def read_request(body: bytes, *, client_sampling: Literal["ignore", "refuse"] = "ignore") -> MessagesRequest:
    """The request, or RequestError naming what is wrong with it."""
    request = validated(body, MessagesRequest)
    choice = (request.tool_choice or {}).get("type", "auto")
    check_policy_rules(None if choice == "auto" else choice, request.sampling_asked(), client_sampling)
    return request


def error_body(error: RequestError) -> dict[str, Any]:
    kind = {404: "not_found_error", 409: "invalid_request_error", 502: "api_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kind.get(error.status, "invalid_request_error"), "message": str(error)}}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content or ()):
        if not (isinstance(block, dict) and block.get("type") == "text"):
            raise RequestError(f"{where}.{j}: only text blocks belong here", param=f"{where}.{j}")
        texts.append(block.get("text", ""))
    return "\n".join(texts)


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results first (as tool messages), then the rest as one user message."""
    tools, parts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            content = block.get("content")
            text = content if isinstance(content, str) else _text(content, f"{where}.content.{j}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            tools.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        elif kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            parts.append({"type": "image", "image": _image_source(block.get("source") or {}, f"{where}.content.{j}")})
        else:
            raise RequestError(f"{where}.content.{j}: a {kind!r} block has no place in a user message")
    user = []
    if parts:
        text_only = all(part["type"] == "text" for part in parts)
        content: Any = "".join(part["text"] for part in parts) if text_only else parts
        user = [{"role": "user", "content": content}]
    return tools + user


def _image_source(source: dict[str, Any], where: str) -> str:
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if source.get("type") == "url":
        return str(source.get("url"))
    raise RequestError(f"{where}: an image source of type {source.get('type')!r}; base64 or url")


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "thinking":
            reasoning.append(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            calls.append(
                {"id": block.get("id"), "type": "function",
                 "function": {"name": block.get("name"), "arguments": block.get("input") or {}}}
            )  # fmt: skip
        else:
            raise RequestError(f"{where}.content.{j}: a {kind!r} block has no place in an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return [message]


def stop_reason(message: dict[str, Any], length: bool) -> Literal["end_turn", "max_tokens", "tool_use"]:
    if length:
        return "max_tokens"
    return "tool_use" if message.get("tool_calls") else "end_turn"


def _blocks(message: dict[str, Any]) -> list[ThinkingBlock | TextBlock | ToolUseBlock]:
    blocks: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
    if message.get("reasoning_content"):
        blocks.append(ThinkingBlock(type="thinking", thinking=message["reasoning_content"], signature=SIGNATURE))
    if message.get("content"):
        blocks.append(TextBlock(type="text", text=message["content"]))
    for call in message.get("tool_calls") or ():
        arguments = json.loads(call["function"]["arguments"])
        blocks.append(ToolUseBlock(type="tool_use", id=call["id"], name=call["function"]["name"], input=arguments))
    return blocks


def reply(
    model: str, message: dict[str, Any], reason: str, input_tokens: int, output_tokens: int, cached: int = 0
) -> Message:
    """`cached`: the input tokens the server found in its prefix cache (Anthropic's `input_tokens` excludes them)."""
    usage = Usage(input_tokens=input_tokens - cached, output_tokens=output_tokens, cache_read_input_tokens=cached)
    return Message(
        id=f"msg_{uuid.uuid4().hex}", type="message", role="assistant", model=model, content=_blocks(message),
        stop_reason=reason, stop_sequence=None, usage=usage,
    )  # fmt: skip


def events(
    model: str, message: dict[str, Any], reason: str, input_tokens: int, output_tokens: int, cached: int = 0
) -> Iterator[Any]:
    """The turn as the stream of events the SDK assembles: each block started, filled and stopped."""
    start = reply(model, message, reason, input_tokens, 0, cached)
    blocks, start.content, start.stop_reason = start.content, [], None
    yield RawMessageStartEvent(type="message_start", message=start)
    for index, block in enumerate(blocks):
        if isinstance(block, ThinkingBlock):
            opened: Any = ThinkingBlock(type="thinking", thinking="", signature="")
            deltas: list[Any] = [ThinkingDelta(type="thinking_delta", thinking=block.thinking)]
            deltas.append({"type": "signature_delta", "signature": block.signature})
        elif isinstance(block, TextBlock):
            opened, deltas = TextBlock(type="text", text=""), [TextDelta(type="text_delta", text=block.text)]
        else:
            opened = ToolUseBlock(type="tool_use", id=block.id, name=block.name, input={})
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block.input, ensure_ascii=False)}]
        yield RawContentBlockStartEvent(type="content_block_start", index=index, content_block=opened)
        for delta in deltas:
            yield RawContentBlockDeltaEvent.model_validate(
                {"type": "content_block_delta", "index": index, "delta": delta}
            )
        yield RawContentBlockStopEvent(type="content_block_stop", index=index)
    yield RawMessageDeltaEvent(
        type="message_delta", delta=Delta(stop_reason=reason, stop_sequence=None),
        usage=MessageDeltaUsage(output_tokens=output_tokens),
    )  # fmt: skip
    yield RawMessageStopEvent(type="message_stop")
