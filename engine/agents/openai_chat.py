"""OpenAI Chat Completions, as the gateway speaks it: the request read and checked (one clear error in the
API's own format for what it cannot serve), the model's turn as a `ChatCompletion` or as `ChatCompletionChunk`
events sent as it is generated, built with the official SDK's own types so that what clients parse is what
OpenAI would send.

Sampling stays the rollout's: a client's temperature, top_p, seed, penalties and the like would make samples
off-policy, so they are ignored and counted (`IGNORED`), or refused with `client_sampling="refuse"`. Its token
cap (`max_completion_tokens`) and `stop` strings end its turn early, as the API says.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from pydantic import ConfigDict, Field, field_validator

from engine.agents.request import RequestError, TurnInfo, check_policy_rules, forces_a_call, sse, validated
from engine.agents.streaming import Sent
from engine.agents.tools import DialectRequest, chat_tools_of, stop_strings
from engine.parsers import ParsedTurn

PATH = "chat/completions"  # the route, under /sessions/<id>/v1/
NAME = "a Chat Completions request"
# Request fields that would change how the model samples: the rollout's settings rule.
IGNORED = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p",
    "repetition_penalty", "reasoning_effort",
)  # fmt: skip
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatRequest(DialectRequest):
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
            if role == "tool" and not _is_id(message.get("tool_call_id")):
                raise ValueError(f"messages[{i}] is a tool message without tool_call_id (a string)")
            if role == "function" and not _is_id(message.get("name")):
                raise ValueError(f"messages[{i}] is a function message without its function's name (a string)")
            if role != "assistant" and "content" not in message:  # an observation is a message with content
                raise ValueError(f"messages[{i}] is a {role} message without content")
            _check_content(message.get("content"), f"messages[{i}].content")
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls is not a list")
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not (
                    isinstance(function, dict) and isinstance(function.get("name"), str) and _is_id(call.get("id"))
                ):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] needs an id and a function name (strings)")
        return messages

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return chat_tools_of(self.tools, self)

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as templates and processors take them: `developer` as `system`, the deprecated
        `function_call` and `function` message as a tool call and its result, `image_url` parts as image parts;
        parts the policy cannot take (audio, files) left out and counted."""
        return [self._as_chat(message) for message in self.messages]

    def _as_chat(self, message: dict[str, Any]) -> dict[str, Any]:
        role = message.get("role")
        if role == "developer":
            message = {**message, "role": "system"}
        elif role == "function":  # the deprecated function calling: the result of the call named so
            message = {"role": "tool", "tool_call_id": message.get("name"), "content": message.get("content")}
        elif role == "assistant" and isinstance(message.get("function_call"), dict) and not message.get("tool_calls"):
            call = message["function_call"]
            message = {**message, "tool_calls": [{"id": call.get("name"), "type": "function", "function": call}]}
        content = message.get("content")
        if not isinstance(content, list):
            return message
        parts = []
        for part in content:
            kind = part["type"]
            if kind == "image_url":
                url = part["image_url"].get("url") if isinstance(part["image_url"], dict) else part["image_url"]
                parts.append({"type": "image", "image": url})
            elif kind in ("text", "refusal"):
                parts.append({"type": "text", "text": part[kind]})
            else:  # audio, a file: not the policy's
                self.leave_out(f"part:{kind}")
        return {**message, "content": parts}

    @property
    def turn_cap(self) -> int | None:
        """The client's per-reply token cap (max_completion_tokens, else the deprecated max_tokens)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.stop)

    def sampling_asked(self) -> list[str]:
        """The sampling fields the client set (which the rollout's settings override)."""
        extra = self.model_extra or {}
        return [name for name in IGNORED if extra.get(name) is not None] + ["tool_choice"] * forces_a_call(
            self.tool_choice
        )


def read_request(raw: Any, *, client_sampling: Literal["ignore", "refuse"] = "ignore") -> ChatRequest:
    """The request, or RequestError naming what is wrong with it."""
    request = validated(raw, ChatRequest)
    if request.n != 1:
        raise RequestError(f"n={request.n}: a session samples one reply per request", param="n")
    check_policy_rules(request.tool_choice, request.sampling_asked(), client_sampling)
    return request


def error_body(error: RequestError) -> dict[str, Any]:
    return error.body()


def _is_id(value: Any) -> bool:
    """A call's id (or a legacy function's name) as the API has it: a non-empty string."""
    return isinstance(value, str) and bool(value)


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{where} is neither text nor a list of parts")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ValueError(f"{where}[{j}] is not a content part (an object with a type)")
        if kind in ("text", "refusal") and not isinstance(part.get(kind), str):
            raise ValueError(f"{where}[{j}] is a {kind} part without its text")
        if kind == "image_url" and not isinstance(part.get("image_url"), dict | str):
            raise ValueError(f"{where}[{j}] is an image_url part without its URL")


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


def finish_reason(message: dict[str, Any], info: TurnInfo) -> Literal["stop", "length", "tool_calls"]:
    if info.length:
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def _usage(info: TurnInfo) -> CompletionUsage:
    prompt, completion, cached = info.tokens
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )  # fmt: skip


def reply(request: ChatRequest, model: str, message: dict[str, Any], info: TurnInfo) -> str:
    calls = [
        ChatCompletionMessageFunctionToolCall(id=call["id"], type="function", function=Function(**call["function"]))
        for call in message.get("tool_calls") or ()
    ]
    answer = ChatCompletionMessage(role="assistant", content=message.get("content"), tool_calls=calls or None)
    if message.get("reasoning_content"):
        setattr(answer, "reasoning_content", message["reasoning_content"])  # noqa: B010 -- SGLang's and vLLM's extra field
    completion = ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()), model=model,
        choices=[Choice(index=0, message=answer, finish_reason=finish_reason(message, info), logprobs=None)],
        usage=_usage(info),
    )  # fmt: skip
    return completion.model_dump_json(exclude_unset=True)


class Stream:
    """The turn as `ChatCompletionChunk` events: the role at once, reasoning and content as they are generated,
    then the rest, each call, the finish, the usage (with `stream_options.include_usage`), and `[DONE]`."""

    def __init__(self, request: ChatRequest, model: str):
        self.id, self.model, self.created = f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time())
        self.include_usage = bool((request.stream_options or {}).get("include_usage"))

    def _chunk(self, delta: ChoiceDelta | None, finish: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [ChunkChoice(index=0, delta=delta, finish_reason=finish)]
        chunk = ChatCompletionChunk(
            id=self.id, object="chat.completion.chunk", created=self.created, model=self.model, choices=choices,
            **extra,
        )  # fmt: skip
        return sse(chunk.model_dump_json(exclude_unset=True))

    def start(self, prompt_tokens: int) -> str:
        return self._chunk(ChoiceDelta(role="assistant", content=""))

    def piece(self, kind: str, text: str) -> str:
        if kind == "content":
            return self._chunk(ChoiceDelta(content=text))
        delta = ChoiceDelta()
        setattr(delta, "reasoning_content", text)  # noqa: B010
        return self._chunk(delta)

    def ping(self) -> str:
        return ": keep-alive\n\n"

    def end(self, message: dict[str, Any], info: TurnInfo, sent: Sent) -> str:
        events = [self.piece(kind, text) for kind, text in sent.rest(message)]
        for index, call in enumerate(message.get("tool_calls") or ()):
            function = ChoiceDeltaToolCallFunction(**call["function"])
            delta = ChoiceDelta(
                tool_calls=[ChoiceDeltaToolCall(index=index, id=call["id"], type="function", function=function)]
            )
            events.append(self._chunk(delta))
        events.append(self._chunk(ChoiceDelta(), finish_reason(message, info)))
        if self.include_usage:
            events.append(self._chunk(None, usage=_usage(info)))
        return "".join(events) + "data: [DONE]\n\n"

    def error(self, error: RequestError) -> str:
        return sse(json.dumps(error.body())) + "data: [DONE]\n\n"
