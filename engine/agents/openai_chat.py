"""OpenAI Chat Completions, as the gateway speaks it: the request read and checked (one clear error in the
API's own format for what it cannot serve), the model's turn as a `ChatCompletion` or as `ChatCompletionChunk`
events, built with the official SDK's own types so that what clients parse is what OpenAI would send.

Sampling stays the rollout's: a client's temperature, top_p, seed, penalties and the like would make samples
off-policy, so they are ignored and counted (`IGNORED`), or refused with `client_sampling="refuse"`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, Literal

from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.completion_usage import CompletionUsage
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.agents.request import RequestError, check_policy_rules, validated
from engine.parsers import ParsedTurn

# Request fields that would change how the model samples: the rollout's settings rule.
IGNORED = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p",
    "repetition_penalty", "reasoning_effort",
)  # fmt: skip
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatRequest(BaseModel):
    """The fields of a chat completion request the gateway reads; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role is {role!r}; one of {', '.join(ROLES)}")
            if role == "tool" and not message.get("tool_call_id"):
                raise ValueError(f"messages[{i}] is a tool message without tool_call_id")
            for j, call in enumerate(message.get("tool_calls") or ()):
                function = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(function, dict) and function.get("name") and call.get("id")):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] needs an id and a function name")
        return messages

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return self.tools

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as templates and processors take them: `image_url` parts as image parts."""
        return [_with_images(message) for message in self.messages]

    @property
    def turn_cap(self) -> int | None:
        """The client's per-reply token cap (max_completion_tokens, else the deprecated max_tokens)."""
        return self.max_completion_tokens or self.max_tokens

    def sampling_asked(self) -> list[str]:
        """The sampling fields the client set (which the rollout's settings override)."""
        extra = self.model_extra or {}
        return [name for name in IGNORED if extra.get(name) is not None]


def read_request(body: bytes, *, client_sampling: Literal["ignore", "refuse"] = "ignore") -> ChatRequest:
    """The request, or RequestError naming what is wrong with it."""
    request = validated(body, ChatRequest)
    if request.n != 1:
        raise RequestError(f"n={request.n}: a session samples one reply per request", param="n")
    check_policy_rules(request.tool_choice, request.sampling_asked(), client_sampling)
    return request


def error_body(error: RequestError) -> dict[str, Any]:
    return error.body()


def _with_images(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [
        {"type": "image", "image": (part.get("image_url") or {}).get("url")}
        if isinstance(part, dict) and part.get("type") == "image_url"
        else part
        for part in content
    ]
    return {**message, "content": parts}


def message_of(turn: ParsedTurn, call_ids: list[str]) -> dict[str, Any]:
    """The assistant message for a parsed turn, as the agent is sent it and will send it back."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
            }
            for call, call_id in zip(turn.tool_calls, call_ids, strict=True)
        ]
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    return message


def finish_reason(message: dict[str, Any], length: bool) -> Literal["stop", "length", "tool_calls"]:
    if length:
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def completion(
    completion_id: str, model: str, message: dict[str, Any], reason: str, usage: CompletionUsage
) -> ChatCompletion:
    calls = [
        ChatCompletionMessageFunctionToolCall(id=call["id"], type="function", function=Function(**call["function"]))
        for call in message.get("tool_calls") or ()
    ]
    reply = ChatCompletionMessage(role="assistant", content=message.get("content"), tool_calls=calls or None)
    if message.get("reasoning_content"):
        setattr(reply, "reasoning_content", message["reasoning_content"])  # noqa: B010 -- SGLang's and vLLM's extra field
    return ChatCompletion(
        id=completion_id, object="chat.completion", created=int(time.time()), model=model,
        choices=[Choice(index=0, message=reply, finish_reason=reason, logprobs=None)], usage=usage,
    )  # fmt: skip


def chunks(
    completion_id: str, model: str, message: dict[str, Any], reason: str, usage: CompletionUsage | None
) -> Iterator[ChatCompletionChunk]:
    """The turn as stream events: the role, the reasoning, the content, each call, the finish, the usage."""
    created = int(time.time())

    def chunk(delta: ChoiceDelta | None, finish: str | None = None, **extra: Any) -> ChatCompletionChunk:
        choices = [] if delta is None else [ChunkChoice(index=0, delta=delta, finish_reason=finish)]
        return ChatCompletionChunk(
            id=completion_id, object="chat.completion.chunk", created=created, model=model, choices=choices, **extra
        )

    yield chunk(ChoiceDelta(role="assistant", content=""))
    if message.get("reasoning_content"):
        delta = ChoiceDelta()
        setattr(delta, "reasoning_content", message["reasoning_content"])  # noqa: B010
        yield chunk(delta)
    if message.get("content"):
        yield chunk(ChoiceDelta(content=message["content"]))
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = ChoiceDeltaToolCallFunction(**call["function"])
        yield chunk(
            ChoiceDelta(
                tool_calls=[ChoiceDeltaToolCall(index=index, id=call["id"], type="function", function=function)]
            )
        )
    yield chunk(ChoiceDelta(), reason)
    if usage is not None:
        yield chunk(None, usage=usage)
