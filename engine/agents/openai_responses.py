"""The OpenAI Responses API, as the gateway speaks it (what the Codex CLI sends): the request's `instructions` and
`input` items turned into the chat messages a template takes, the model's turn as a `Response` or as the stream
of events the SDK assembles, built with the official SDK's own types.

    instructions                                   ->  a system message
    message items (user, system, developer, ...)   ->  messages (developer as system)
    reasoning, assistant message, function_call    ->  one assistant message (reasoning_content, content,
                                                       tool_calls by call_id), as the model's turn was
    function_call_output                           ->  a tool message answering its call_id

The gateway keeps no responses: each request sends its whole input (as the Codex CLI does, `store: false`);
`previous_response_id` is refused with that said. Function tools only. Sampling fields follow the rollout's
settings, as for Chat Completions.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response_reasoning_item import Content
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel, ConfigDict, Field

from engine.agents.openai_chat import IGNORED, error_body  # noqa: F401 -- OpenAI's error format, for the gateway
from engine.agents.request import RequestError, check_policy_rules, validated

ROLES = ("system", "developer", "user", "assistant")


class ResponsesRequest(BaseModel):
    """The fields of a Responses request the gateway reads; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    previous_response_id: str | None = None
    stream: bool = False

    @property
    def turn_cap(self) -> int | None:
        return self.max_output_tokens

    def sampling_asked(self) -> list[str]:
        extra = self.model_extra or {}
        return [name for name in (*IGNORED, "reasoning") if extra.get(name) is not None]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the shape chat templates take; RequestError for any other kind."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise RequestError(
                    f"tools[{i}] is a {tool.get('type')!r} tool; the gateway serves function tools", param=f"tools.{i}"
                )
            function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
            out.append({"type": "function", "function": function})
        return out

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages; RequestError for an item it cannot take."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        turn: dict[str, Any] | None = None  # the assistant message being gathered from consecutive items
        for i, item in enumerate(items):
            kind, where = item.get("type", "message"), f"input.{i}"
            if kind in ("reasoning", "function_call") or (kind == "message" and item.get("role") == "assistant"):
                if turn is None:
                    turn = {"role": "assistant", "content": None}
                    out.append(turn)
                _gather(turn, item, kind, where)
                continue
            turn = None
            if kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else _text(output or [], where)
                out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
            elif kind == "message":
                role = item.get("role")
                if role not in ROLES:
                    raise RequestError(f"{where}.role is {role!r}; one of {', '.join(ROLES)}", param=f"{where}.role")
                content = item.get("content")
                parts = content if isinstance(content, str) else _parts(content or [], where)
                out.append({"role": "system" if role == "developer" else role, "content": parts})
            else:
                raise RequestError(
                    f"{where} is a {kind!r} item; the gateway takes messages, reasoning, function calls and their "
                    "outputs",
                    param=where,
                )
        return out


def read_request(body: bytes, *, client_sampling: Literal["ignore", "refuse"] = "ignore") -> ResponsesRequest:
    """The request, or RequestError naming what is wrong with it."""
    request = validated(body, ResponsesRequest)
    if request.previous_response_id is not None:
        raise RequestError(
            "previous_response_id: the gateway keeps no responses; send the whole input (store: false)",
            param="previous_response_id",
        )
    check_policy_rules(request.tool_choice, request.sampling_asked(), client_sampling)
    return request


def _gather(turn: dict[str, Any], item: dict[str, Any], kind: str, where: str) -> None:
    if kind == "reasoning":
        texts = [part.get("text", "") for part in (item.get("content") or item.get("summary") or [])]
        turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(texts)
    elif kind == "function_call":
        function = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
        turn.setdefault("tool_calls", []).append({"id": item.get("call_id"), "type": "function", "function": function})
    else:
        content = item.get("content")
        text = content if isinstance(content, str) else _text(content or [], where)
        turn["content"] = (turn["content"] or "") + text


def _text(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")):
            raise RequestError(f"{where}.content.{j}: only text belongs here", param=f"{where}.content.{j}")
        texts.append(part.get("text", ""))
    return "".join(texts)


def _parts(parts: list[Any], where: str) -> str | list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            out.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and part.get("image_url"):
            out.append({"type": "image", "image": part["image_url"]})
        else:
            raise RequestError(f"{where}.content.{j}: a {kind!r} part the gateway cannot take (text, image_url images)")
    if all(part["type"] == "text" for part in out):
        return "".join(part["text"] for part in out)
    return out


def _output(message: dict[str, Any], *, done: bool = True) -> list[Any]:
    """The output items of a turn: its reasoning, its text, its calls."""
    status = "completed" if done else "in_progress"
    items: list[Any] = []
    if message.get("reasoning_content"):
        content = [Content(type="reasoning_text", text=message["reasoning_content"])]
        items.append(ResponseReasoningItem(id=_id("rs"), type="reasoning", summary=[], content=content, status=status))
    if message.get("content"):
        text = ResponseOutputText(type="output_text", text=message["content"], annotations=[])
        items.append(
            ResponseOutputMessage(id=_id("msg"), type="message", role="assistant", status=status, content=[text])
        )
    for call in message.get("tool_calls") or ():
        items.append(
            ResponseFunctionToolCall(
                type="function_call", id=_id("fc"), call_id=call["id"], name=call["function"]["name"],
                arguments=call["function"]["arguments"], status=status,
            )
        )  # fmt: skip
    return items


def reply(
    model: str, message: dict[str, Any], length: bool, input_tokens: int, output_tokens: int, cached: int = 0
) -> Response:
    return _response(_id("resp"), model, _output(message), length, input_tokens, output_tokens, cached)


def _response(
    response_id: str,
    model: str,
    output: list[Any],
    length: bool | None,
    input_tokens: int,
    output_tokens: int,
    cached: int = 0,
) -> Response:
    """`length` None: still in progress. `cached`: the input tokens the server found in its prefix cache."""
    status = "in_progress" if length is None else "incomplete" if length else "completed"
    usage = ResponseUsage(
        input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=0),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
    )  # fmt: skip
    return Response(
        id=response_id, object="response", created_at=time.time(), model=model, output=output, status=status,
        parallel_tool_calls=True, tool_choice="auto", tools=[], usage=None if length is None else usage,
        incomplete_details={"reason": "max_output_tokens"} if length else None,
    )  # fmt: skip


def events(
    model: str, message: dict[str, Any], length: bool, input_tokens: int, output_tokens: int, cached: int = 0
) -> Iterator[Any]:
    """The turn as the stream of events the SDK assembles: created, each item added, filled and done, completed."""
    response_id, items = _id("resp"), _output(message)
    number = iter(range(1_000_000))
    started = _response(response_id, model, [], None, input_tokens, 0)
    yield ResponseCreatedEvent(type="response.created", sequence_number=next(number), response=started)
    yield ResponseInProgressEvent(type="response.in_progress", sequence_number=next(number), response=started)
    for index, item in enumerate(items):
        if isinstance(item, ResponseOutputMessage):
            opened: Any = item.model_copy(update={"content": [], "status": "in_progress"})
        elif isinstance(item, ResponseFunctionToolCall):
            opened = item.model_copy(update={"arguments": "", "status": "in_progress"})
        else:
            opened = item.model_copy(update={"content": [], "status": "in_progress"})
        yield ResponseOutputItemAddedEvent(
            type="response.output_item.added", item=opened, output_index=index, sequence_number=next(number)
        )
        if isinstance(item, ResponseOutputMessage):
            part = item.content[0]
            empty = part.model_copy(update={"text": ""})
            common = {"item_id": item.id, "output_index": index, "content_index": 0}
            yield ResponseContentPartAddedEvent(
                type="response.content_part.added", part=empty, sequence_number=next(number), **common
            )
            yield ResponseTextDeltaEvent(
                type="response.output_text.delta", delta=part.text, logprobs=[], sequence_number=next(number), **common
            )
            yield ResponseTextDoneEvent(
                type="response.output_text.done", text=part.text, logprobs=[], sequence_number=next(number), **common
            )
            yield ResponseContentPartDoneEvent(
                type="response.content_part.done", part=part, sequence_number=next(number), **common
            )
        elif isinstance(item, ResponseFunctionToolCall):
            common = {"item_id": item.id or "", "output_index": index}
            yield ResponseFunctionCallArgumentsDeltaEvent(
                type="response.function_call_arguments.delta",
                delta=item.arguments,
                sequence_number=next(number),
                **common,
            )
            yield ResponseFunctionCallArgumentsDoneEvent(
                type="response.function_call_arguments.done",
                arguments=item.arguments,
                sequence_number=next(number),
                **common,
            )
        else:
            text = item.content[0].text if item.content else ""
            yield ResponseReasoningTextDeltaEvent(
                type="response.reasoning_text.delta", item_id=item.id, output_index=index, content_index=0, delta=text,
                sequence_number=next(number),
            )  # fmt: skip
        yield ResponseOutputItemDoneEvent(
            type="response.output_item.done", item=item, output_index=index, sequence_number=next(number)
        )
    final = _response(response_id, model, items, length, input_tokens, output_tokens, cached)
    yield ResponseCompletedEvent(type="response.completed", sequence_number=next(number), response=final)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
