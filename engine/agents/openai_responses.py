"""The OpenAI Responses API, as the gateway speaks it (what the Codex CLI sends): the request's `instructions` and
`input` items turned into the chat messages a template takes, the model's turn as a `Response` or as the stream
of events the SDK assembles, sent as it is generated, built with the official SDK's own types.

    instructions                                   ->  a system message
    message items (user, system, developer, ...)   ->  messages (developer as system)
    reasoning, assistant message, calls            ->  one assistant message (reasoning_content, content,
                                                       tool_calls by call_id), as the model's turn was
    *_call_output items                            ->  tool messages answering their call_id

Tools: function tools as they are; custom (free-form) tools as a function of one string `input`, whose calls go
back as `custom_tool_call` items; a namespace's tools flattened to functions named `<namespace>.<tool>`, whose
calls go back with their namespace; a client-run tool search as a function; the tools of `additional_tools` input
items as the request's own (Codex's code-mode models send theirs there). Hosted tools the policy cannot call
(web search, file search, code interpreter, ...) and their items are left out of the prompt and counted
(`degraded()`). The gateway keeps no responses: each request sends its whole input (as the Codex CLI does,
`store: false`); `previous_response_id` is refused with that said. Sampling fields follow the rollout's settings.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from openai.types.responses import (
    Response,
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseUsage,
)
from openai.types.responses.response_reasoning_item import Content
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import ConfigDict, Field, PrivateAttr

from engine.agents.openai_chat import IGNORED, error_body  # noqa: F401 -- OpenAI's error format, for the gateway
from engine.agents.request import RequestError, TurnInfo, check_policy_rules, forces_a_call, sse, validated
from engine.agents.streaming import Sent
from engine.agents.tools import DialectRequest, function_tool

PATH = "responses"  # the route, under /sessions/<id>/v1/
NAME = "a Responses request"
ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
CALLS = {"function_call": "function", "custom_tool_call": "custom", "tool_search_call": "tool_search"}
OUTPUTS = ("function_call_output", "custom_tool_call_output", "tool_search_output")  # of CALLS
FREE_FORM = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


@dataclass(frozen=True, slots=True)
class Offered:
    """A tool as the client offered it: its kind (function, custom, tool_search), its name, its namespace."""

    kind: str
    name: str
    namespace: str | None = None


class ResponsesRequest(DialectRequest):
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
    _offered: dict[str, Offered] = PrivateAttr(default_factory=dict)  # the name the policy calls -> the tool

    @property
    def turn_cap(self) -> int | None:
        return self.max_output_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return ()

    def sampling_asked(self) -> list[str]:
        extra = self.model_extra or {}
        return [name for name in IGNORED if extra.get(name) is not None] + ["tool_choice"] * forces_a_call(
            self.tool_choice
        )

    def offered(self, name: str) -> Offered:
        """What the client offered under the name the policy called."""
        return self._offered.get(name, Offered("function", name))

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in the shape chat templates take (the module's docstring says how each kind is)."""
        offered = [(tool, f"tools.{i}") for i, tool in enumerate(self.tools or ())]
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            if (
                isinstance(item, dict)
                and item.get("type") == "additional_tools"
                and isinstance(item.get("tools"), list)
            ):
                offered += [(tool, f"input.{i}.tools.{j}") for j, tool in enumerate(item["tools"])]
        out: list[dict[str, Any]] = []
        for tool, where in offered:
            if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
                for j, inner in enumerate(tool["tools"]):
                    out += self._tool(inner, f"{where}.tools.{j}", namespace=str(tool.get("name")))
            else:
                out += self._tool(tool, where)
        return out or None

    def _tool(self, tool: Any, where: str, namespace: str | None = None) -> list[dict[str, Any]]:
        if not isinstance(tool, dict):
            raise RequestError(f"{where} is not an object", param=where)
        kind, name = tool.get("type"), tool.get("name")
        called = f"{namespace}.{name}" if namespace else name
        if kind == "function":
            made = function_tool(called, tool.get("description"), tool.get("parameters"), where)
        elif kind == "custom":
            described = _free_form(tool)
            made = function_tool(called, described, FREE_FORM, where)
        elif kind == "tool_search" and tool.get("execution") == "client":
            name = called = "tool_search"
            made = function_tool(called, tool.get("description"), tool.get("parameters"), where)
        else:
            self.leave_out(f"tool:{kind}")
            return []
        self._offered[str(called)] = Offered(kind, str(name), namespace)
        return [made]

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages; RequestError for an item that cannot be read."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        turn: dict[str, Any] | None = None  # the assistant message being gathered from consecutive items
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise RequestError(f"input.{i} is not an object", param=f"input.{i}")
            kind, where = item.get("type", "message"), f"input.{i}"
            if kind in ("reasoning", *CALLS) or (kind == "message" and item.get("role") == "assistant"):
                if turn is None:
                    turn = {"role": "assistant", "content": None}
                    out.append(turn)
                self._gather(turn, item, kind, where)
                continue
            turn = None
            if kind in OUTPUTS:
                out.append({"role": "tool", "tool_call_id": _call_id(item, where), "content": _output(item, where)})
            elif kind == "message":
                role = item.get("role")
                if role not in ROLES:
                    raise RequestError(f"{where}.role is {role!r}; one of {', '.join(ROLES)}", param=f"{where}.role")
                content = item.get("content")
                parts = content if isinstance(content, str) else self._parts(content, where)
                out.append({"role": "system" if role == "developer" else role, "content": parts})
            elif kind != "additional_tools":  # (whose tools are offered: chat_tools)
                # a hosted tool's call or output, a compaction, a reference to a stored item: not the policy's
                self.leave_out(f"item:{kind}")
        return out

    def _gather(self, turn: dict[str, Any], item: dict[str, Any], kind: str, where: str) -> None:
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            turn["reasoning_content"] = turn.get("reasoning_content", "") + _text(parts, where)
        elif kind in CALLS:
            call_id = _call_id(item, where)
            name = item.get("name") if kind != "tool_search_call" else "tool_search"
            if not isinstance(name, str):
                raise RequestError(f"{where}: a call needs a name", param=where)
            if item.get("namespace"):
                name = f"{item['namespace']}.{name}"
            if kind == "custom_tool_call":
                arguments: Any = {"input": item.get("input", "")}
            else:
                arguments = item.get("arguments", "{}")
            function = {"name": name, "arguments": arguments}
            turn.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": function})
        else:
            content = item.get("content")
            text = content if isinstance(content, str) else _text(content or [], where)
            turn["content"] = (turn["content"] or "") + text

    def _parts(self, parts: Any, where: str) -> str | list[dict[str, Any]]:
        if not isinstance(parts, list):
            raise RequestError(f"{where}.content is neither text nor a list of parts", param=f"{where}.content")
        out: list[dict[str, Any]] = []
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PARTS and isinstance(part.get("text", part.get("refusal")), str):
                out.append({"type": "text", "text": part.get("text", part.get("refusal"))})
            elif kind == "input_image" and isinstance(part.get("image_url"), str):
                out.append({"type": "image", "image": part["image_url"]})
            elif isinstance(part, dict):
                self.leave_out(f"part:{kind}")
            else:
                raise RequestError(f"{where}.content.{j} is not a content part", param=f"{where}.content.{j}")
        if all(part["type"] == "text" for part in out):
            return "".join(part["text"] for part in out)
        return out


def read_request(raw: Any, *, client_sampling: Literal["ignore", "refuse"] = "ignore") -> ResponsesRequest:
    """The request, or RequestError naming what is wrong with it."""
    request = validated(raw, ResponsesRequest)
    if request.previous_response_id is not None:
        raise RequestError(
            "previous_response_id: the gateway keeps no responses; send the whole input (store: false)",
            param="previous_response_id",
        )
    check_policy_rules(request.tool_choice, request.sampling_asked(), client_sampling)
    return request


def _free_form(tool: dict[str, Any]) -> str:
    """A custom tool's description, with the format its free-form input follows (a grammar, say)."""
    described = tool.get("description") if isinstance(tool.get("description"), str) else ""
    form = tool.get("format")
    if isinstance(form, dict) and isinstance(form.get("definition"), str):
        described += f"\n\nThe input follows this {form.get('syntax') or 'grammar'} grammar:\n{form['definition']}"
    return described + "\n\nCall it with the whole free-form input as the string argument `input`."


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise RequestError(f"{where}: no call_id", param=f"{where}.call_id")
    return call_id


def _output(item: dict[str, Any], where: str) -> str:
    output = item.get("output", item.get("tools"))
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and "text" in p for p in output):
        return _text(output, where)
    return json.dumps(output, ensure_ascii=False)


def _text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise RequestError(f"{where}: a list of text parts", param=where)
    texts = []
    for j, part in enumerate(parts):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise RequestError(f"{where}.content.{j}: only text belongs here", param=f"{where}.content.{j}")
        texts.append(text)
    return "".join(texts)


def _output_items(request: ResponsesRequest, message: dict[str, Any], status: str = "completed") -> list[Any]:
    """The output items of a turn: its reasoning, its text, its calls (each as the kind of tool it calls)."""
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
        items.append(_call_item(request, call, status))
    return items


def _call_item(request: ResponsesRequest, call: dict[str, Any], status: str) -> Any:
    tool = request.offered(call["function"]["name"])
    arguments = call["function"]["arguments"]
    if tool.kind == "custom":
        given = json.loads(arguments)
        text = given.get("input") if isinstance(given, dict) and isinstance(given.get("input"), str) else arguments
        return ResponseCustomToolCall(
            type="custom_tool_call", id=_id("ctc"), call_id=call["id"], name=tool.name, input=text,
            namespace=tool.namespace,
        )  # fmt: skip
    if tool.kind == "tool_search":
        return {
            "type": "tool_search_call", "id": _id("ts"), "call_id": call["id"], "execution": "client",
            "arguments": json.loads(arguments), "status": status,
        }  # fmt: skip
    return ResponseFunctionToolCall(
        type="function_call", id=_id("fc"), call_id=call["id"], name=tool.name, arguments=arguments, status=status,
        namespace=tool.namespace,
    )  # fmt: skip


def _response(response_id: str, model: str, output: list[Any], info: TurnInfo | None) -> Response:
    """`info` None: still in progress."""
    status = "in_progress" if info is None else "incomplete" if info.length else "completed"
    usage = None
    if info is not None:
        prompt, completion, cached = info.tokens
        usage = ResponseUsage(
            input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion,
            input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=0),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        )  # fmt: skip
    return Response.model_construct(
        id=response_id, object="response", created_at=time.time(), model=model, output=output, status=status,
        parallel_tool_calls=True, tool_choice="auto", tools=[], usage=usage,
        incomplete_details={"reason": "max_output_tokens"} if info is not None and info.length else None,
    )  # fmt: skip


def _dump(value: Any) -> Any:
    return value.model_dump(exclude_unset=True, exclude_none=True) if hasattr(value, "model_dump") else value


def reply(request: ResponsesRequest, model: str, message: dict[str, Any], info: TurnInfo) -> str:
    response = _response(_id("resp"), model, _output_items(request, message), info)
    return json.dumps({**_dump(response), "output": [_dump(item) for item in response.output]}, ensure_ascii=False)


class Stream:
    """The turn as the events the SDK assembles: created at once, a reasoning item and a message item filled as
    they are generated, then the rest, each call item, and the completed (or incomplete) response."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request, self.model, self.id = request, model, _id("resp")
        self.number = 0
        self.items: list[dict[str, Any]] = []  # output items so far (as sent when done)
        self.open: dict[str, Any] | None = None  # the item being filled: {"kind", "id", "text"}

    def _event(self, data: dict[str, Any]) -> str:
        data["sequence_number"] = self.number
        self.number += 1
        return sse(json.dumps(data, ensure_ascii=False), data["type"])

    def start(self, prompt_tokens: int) -> str:
        started = {**_dump(_response(self.id, self.model, [], None)), "output": []}
        return self._event({"type": "response.created", "response": started}) + self._event(
            {"type": "response.in_progress", "response": started}
        )

    def piece(self, kind: str, text: str) -> str:
        events = []
        if self.open is None or self.open["kind"] != kind:
            events += [self._close(), self._open(kind)]
        assert self.open is not None
        self.open["text"] += text
        common = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0, "delta": text}
        if kind == "reasoning":
            events.append(self._event({"type": "response.reasoning_text.delta", **common}))
        else:
            events.append(self._event({"type": "response.output_text.delta", **common, "logprobs": []}))
        return "".join(events)

    def _open(self, kind: str) -> str:
        self.open = {"kind": kind, "id": _id("rs" if kind == "reasoning" else "msg"), "text": ""}
        if kind == "reasoning":
            item = {"type": "reasoning", "id": self.open["id"], "summary": [], "content": [], "status": "in_progress"}
            added = self._event({"type": "response.output_item.added", "item": item, "output_index": len(self.items)})
            return added
        item = {"type": "message", "id": self.open["id"], "role": "assistant", "content": [], "status": "in_progress"}
        part = {"type": "output_text", "text": "", "annotations": []}
        common = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        return self._event({"type": "response.output_item.added", "item": item, "output_index": len(self.items)}) + (
            self._event({"type": "response.content_part.added", "part": part, **common})
        )

    def _close(self) -> str:
        if self.open is None:
            return ""
        opened, self.open = self.open, None
        index, text = len(self.items), opened["text"]
        common = {"item_id": opened["id"], "output_index": index, "content_index": 0}
        if opened["kind"] == "reasoning":
            item = {
                "type": "reasoning", "id": opened["id"], "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": text}],
            }  # fmt: skip
            events = [self._event({"type": "response.reasoning_text.done", **common, "text": text})]
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            item = {
                "type": "message",
                "id": opened["id"],
                "role": "assistant",
                "content": [part],
                "status": "completed",
            }
            events = [
                self._event({"type": "response.output_text.done", **common, "text": text, "logprobs": []}),
                self._event({"type": "response.content_part.done", **common, "part": part}),
            ]
        self.items.append(item)
        events.append(self._event({"type": "response.output_item.done", "item": item, "output_index": index}))
        return "".join(events)

    def ping(self) -> str:
        return ": keep-alive\n\n"

    def end(self, message: dict[str, Any], info: TurnInfo, sent: Sent) -> str:
        events = [self.piece(kind, text) for kind, text in sent.rest(message)]
        events.append(self._close())
        for call in message.get("tool_calls") or ():
            item = _dump(_call_item(self.request, call, "completed"))
            index = len(self.items)
            opened = {**item, "status": "in_progress"}
            events.append(self._event({"type": "response.output_item.added", "item": opened, "output_index": index}))
            common = {"item_id": item["id"], "output_index": index}
            if item["type"] == "function_call":
                events.append(
                    self._event(
                        {"type": "response.function_call_arguments.delta", **common, "delta": item["arguments"]}
                    )
                )
                events.append(
                    self._event(
                        {"type": "response.function_call_arguments.done", **common, "arguments": item["arguments"]}
                    )
                )
            elif item["type"] == "custom_tool_call":
                events.append(
                    self._event({"type": "response.custom_tool_call_input.delta", **common, "delta": item["input"]})
                )
                events.append(
                    self._event({"type": "response.custom_tool_call_input.done", **common, "input": item["input"]})
                )
            self.items.append(item)
            events.append(self._event({"type": "response.output_item.done", "item": item, "output_index": index}))
        final = {**_dump(_response(self.id, self.model, [], info)), "output": self.items}
        kind = "response.incomplete" if info.length else "response.completed"
        events.append(self._event({"type": kind, "response": final}))
        return "".join(events)

    def error(self, error: RequestError) -> str:
        failed = {**_dump(_response(self.id, self.model, [], None)), "output": self.items, "status": "failed"}
        failed["error"] = {"code": error.code or "server_error", "message": str(error)}
        return self._event({"type": "response.failed", "response": failed})


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
