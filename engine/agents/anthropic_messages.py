"""Anthropic Messages, as the gateway speaks it (what Claude Code and the `anthropic` SDK send): the request read
and turned into the chat messages a template takes, the model's turn as a `Message` or as the stream of events
the SDK parses, sent as it is generated, built with the official SDK's own types.

    system + messages          ->  system, user, assistant (content, reasoning_content, tool_calls), tool, ...
    a system message in messages ->  a system message where it stands
    tool_result blocks         ->  tool messages (`tool_call_id` = tool_use_id), before the user's text
    thinking / tool_use blocks ->  the assistant's reasoning_content / tool_calls
    document blocks (text)     ->  text

What the policy cannot take is left out of its prompt and counted (`degraded()`): the provider's server tools
(web search, code execution) and their result blocks, deferred tools, redacted thinking, a block of a kind
unknown here. Sampling fields (temperature, top_p, top_k) and the request's `thinking` and `output_config` follow
the rollout's settings, as for Chat Completions; `stop_sequences` and `max_tokens` end the turn early.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from anthropic.types import Message, TextBlock, ThinkingBlock, ToolUseBlock, Usage
from pydantic import ConfigDict, Field

from engine.agents.request import RequestError, TurnInfo, check_policy_rules, forces_a_call, sse, validated
from engine.agents.streaming import Sent
from engine.agents.tools import DialectRequest, function_tool, stop_strings

PATH = "messages"  # the route, under /sessions/<id>/v1/
NAME = "a Messages request"
IGNORED = ("temperature", "top_p", "top_k")
SIGNATURE = "turnstile"  # thinking blocks carry a signature; the gateway's is constant (nothing to verify)
# Anthropic-defined tools the client runs (a name and a type, no schema): the schema their calls follow
CLIENT_TOOLS = {
    "bash": {"type": "object", "properties": {"command": {"type": "string"}, "restart": {"type": "boolean"}}},
    "text_editor": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": {"type": "string"}, "file_text": {"type": "string"}, "old_str": {"type": "string"},
            "new_str": {"type": "string"}, "insert_line": {"type": "integer"},
            "view_range": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["command", "path"],
    },
    "memory": {"type": "object", "properties": {"command": {"type": "string"}, "path": {"type": "string"}}},
}  # fmt: skip

ASSISTANT_BLOCKS = ("tool_use", "thinking", "redacted_thinking", "server_tool_use")  # refused in a user message
USER_BLOCKS = ("tool_result", "image", "document")  # refused in an assistant message


class MessagesRequest(DialectRequest):
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

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.stop_sequences)

    def sampling_asked(self) -> list[str]:
        return [name for name in IGNORED if getattr(self, name) is not None] + ["tool_choice"] * forces_a_call(
            self.tool_choice
        )

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in the shape chat templates take: custom tools, and the client-run tools Anthropic defines
        (bash, text_editor, memory) with their schemas; server tools and deferred ones are left out."""
        out = []
        for i, tool in enumerate(self.tools or ()):
            kind, where = tool.get("type") or "custom", f"tools.{i}"
            base = kind.rsplit("_", 1)[0] if kind[-8:].isdigit() else kind
            if tool.get("defer_loading"):
                self.leave_out("tool:deferred")
            elif kind == "custom":
                out.append(function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), where))
            elif base in CLIENT_TOOLS:
                out.append(function_tool(tool.get("name") or base, f"The {base} tool.", CLIENT_TOOLS[base], where))
            else:
                self.leave_out(f"tool:{base}")
        return out or None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages; RequestError for a block that cannot be read."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            role, content = message.get("role"), message.get("content")
            where = f"messages.{i}"
            if role not in ("user", "assistant", "system"):
                raise RequestError(f"{where}.role is {role!r}; 'user' or 'assistant'", param=f"{where}.role")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(blocks, list) or not all(isinstance(block, dict) for block in blocks):
                raise RequestError(f"{where}.content is neither text nor a list of blocks", param=f"{where}.content")
            if role == "system":
                out.append({"role": "system", "content": _text(blocks, f"{where}.content")})
            elif role == "assistant":
                out += self._assistant(blocks, where)
            else:
                out += self._user(blocks, where)
        return out

    def _user(self, blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
        """Tool results first (as tool messages), then the rest as one user message."""
        tools, parts = [], []
        for j, block in enumerate(blocks):
            kind, here = block.get("type"), f"{where}.content.{j}"
            if kind == "tool_result":
                if not isinstance(block.get("tool_use_id"), str):
                    raise RequestError(f"{here}: a tool_result needs its tool_use_id", param=here)
                content = self._result(block.get("content"), f"{here}.content")
                if block.get("is_error"):
                    content = f"Error: {content}" if isinstance(content, str) else content
                tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
            elif kind in ("text", "image", "document"):
                parts += self._parts([block], here)
            elif kind in ASSISTANT_BLOCKS:
                raise RequestError(f"{here}: a {kind!r} block has no place in a user message", param=here)
            else:  # a server tool's result block, a container upload, a kind unknown here
                self.leave_out(f"block:{kind}")
        user = [{"role": "user", "content": _joined(parts)}] if parts else []
        return tools + user

    def _result(self, content: Any, where: str) -> str | list[dict[str, Any]]:
        if content is None or isinstance(content, str):
            return content or ""
        if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
            raise RequestError(f"{where}: text or a list of blocks", param=where)
        return _joined(self._parts(content, where))

    def _parts(self, blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
        parts = []
        for j, block in enumerate(blocks):
            kind, here = block.get("type"), f"{where}.{j}"
            if kind == "text":
                parts.append({"type": "text", "text": _string(block.get("text"), here)})
            elif kind == "image":
                parts.append({"type": "image", "image": _image_source(block.get("source"), here)})
            elif kind == "document" and isinstance(block.get("source"), dict) and block["source"].get("type") == "text":
                parts.append({"type": "text", "text": _string(block["source"].get("data"), here)})
            else:
                self.leave_out(f"block:{kind}")
        return parts

    def _assistant(self, blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
        text, reasoning, calls = [], [], []
        for j, block in enumerate(blocks):
            kind, here = block.get("type"), f"{where}.content.{j}"
            if kind == "text":
                text.append(_string(block.get("text"), here))
            elif kind == "thinking":
                reasoning.append(_string(block.get("thinking"), here))
            elif kind == "tool_use":
                if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
                    raise RequestError(f"{here}: a tool_use needs an id and a name", param=here)
                function = {"name": block["name"], "arguments": block.get("input") or {}}
                calls.append({"id": block["id"], "type": "function", "function": function})
            elif kind in USER_BLOCKS:
                raise RequestError(f"{here}: a {kind!r} block has no place in an assistant message", param=here)
            else:  # redacted thinking, a server tool's call, a kind unknown here
                self.leave_out(f"block:{kind}")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        return [message]


def read_request(raw: Any, *, client_sampling: Literal["ignore", "refuse"] = "ignore") -> MessagesRequest:
    """The request, or RequestError naming what is wrong with it."""
    request = validated(raw, MessagesRequest)
    check_policy_rules(request.tool_choice, request.sampling_asked(), client_sampling)
    return request


ERROR_TYPES = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
    429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def error_body(error: RequestError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(error.status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(error)}}


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where}: text expected", param=where)
    return value


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: text or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        if not (isinstance(block, dict) and block.get("type") == "text"):
            raise RequestError(f"{where}.{j}: only text blocks belong here", param=f"{where}.{j}")
        texts.append(_string(block.get("text"), f"{where}.{j}"))
    return "\n".join(texts)


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts as one string (as a template takes it); a list where it holds images."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image_source(source: Any, where: str) -> str:
    if isinstance(source, dict) and source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{_string(source.get('data'), where)}"
    if isinstance(source, dict) and source.get("type") == "url":
        return str(source.get("url"))  # refused by the gateway's image check: it fetches no URL
    raise RequestError(f"{where}: an image source of type base64", param=where)


def stop_reason(message: dict[str, Any], info: TurnInfo) -> str:
    if info.length:
        return "max_tokens"
    if info.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if message.get("tool_calls") else "end_turn"


def _usage(info: TurnInfo) -> Usage:
    """Anthropic's `input_tokens` excludes those read from the prompt cache."""
    prompt, completion, cached = info.tokens
    return Usage(input_tokens=prompt - cached, output_tokens=completion, cache_read_input_tokens=cached)


def _calls(message: dict[str, Any]) -> list[ToolUseBlock]:
    return [
        ToolUseBlock(
            type="tool_use",
            id=call["id"],
            name=call["function"]["name"],
            input=json.loads(call["function"]["arguments"]),
        )
        for call in message.get("tool_calls") or ()
    ]


def reply(request: MessagesRequest, model: str, message: dict[str, Any], info: TurnInfo) -> str:
    blocks: list[Any] = []
    if message.get("reasoning_content"):
        blocks.append(ThinkingBlock(type="thinking", thinking=message["reasoning_content"], signature=SIGNATURE))
    if message.get("content"):
        blocks.append(TextBlock(type="text", text=message["content"]))
    blocks += _calls(message)
    answer = Message(
        id=f"msg_{uuid.uuid4().hex}", type="message", role="assistant", model=model, content=blocks,
        stop_reason=stop_reason(message, info), stop_sequence=info.stop_sequence, usage=_usage(info),
    )  # fmt: skip
    return answer.model_dump_json(exclude_unset=True)


class Stream:
    """The turn as the events the SDK assembles: the message started at once, a thinking block and a text block
    filled as they are generated, then the rest, each tool_use block, the stop reason and usage, the end."""

    def __init__(self, request: MessagesRequest, model: str):
        self.model = model
        self.index = -1  # the block open now, or the last one
        self.open: str | None = None  # its kind ("thinking", "text"), while open

    def _event(self, data: dict[str, Any]) -> str:
        return sse(json.dumps(data, ensure_ascii=False), data["type"])

    def start(self, prompt_tokens: int) -> str:
        message = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }  # fmt: skip
        return self._event({"type": "message_start", "message": message})

    def piece(self, kind: str, text: str) -> str:
        block = "thinking" if kind == "reasoning" else "text"
        events = [] if self.open == block else [self._close(), self._open(block)]
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if block == "thinking"
            else {"type": "text_delta", "text": text}
        )
        events.append(self._event({"type": "content_block_delta", "index": self.index, "delta": delta}))
        return "".join(events)

    def _open(self, block: str) -> str:
        self.index, self.open = self.index + 1, block
        opened = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if block == "thinking"
            else {"type": "text", "text": ""}
        )
        return self._event({"type": "content_block_start", "index": self.index, "content_block": opened})

    def _close(self) -> str:
        if self.open is None:
            return ""
        events = []
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": SIGNATURE}
            events.append(self._event({"type": "content_block_delta", "index": self.index, "delta": delta}))
        events.append(self._event({"type": "content_block_stop", "index": self.index}))
        self.open = None
        return "".join(events)

    def ping(self) -> str:
        return self._event({"type": "ping"})

    def end(self, message: dict[str, Any], info: TurnInfo, sent: Sent) -> str:
        events = [self.piece(kind, text) for kind, text in sent.rest(message)]
        events.append(self._close())
        for call in _calls(message):
            self.index += 1
            opened = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            events.append(self._event({"type": "content_block_start", "index": self.index, "content_block": opened}))
            delta = {"type": "input_json_delta", "partial_json": json.dumps(call.input, ensure_ascii=False)}
            events.append(self._event({"type": "content_block_delta", "index": self.index, "delta": delta}))
            events.append(self._event({"type": "content_block_stop", "index": self.index}))
        usage = _usage(info).model_dump(exclude_none=True)
        delta = {"stop_reason": stop_reason(message, info), "stop_sequence": info.stop_sequence}
        events.append(self._event({"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(self._event({"type": "message_stop"}))
        return "".join(events)

    def error(self, error: RequestError) -> str:
        return self._event(error_body(error))
