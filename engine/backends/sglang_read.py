"""A turn read by SGLang's own parsers, on an SGLang server: `POST /separate_reasoning` splits the reasoning from
the rest, then `POST /parse_function_call` finds the tool calls in the rest, by the `--reasoning-parser` and
`--tool-call-parser` names SGLang registers (44 tool-call parsers in SGLang 0.5.23, of which the engine has 9 of
its own). What SGLang's chat completions would make of the turn is what the env gets.

    turn = await read_turn(server, text, tools=schemas, tool_call_parser="minimax-m2", reasoning_parser="minimax")
    turn.reasoning, turn.content, turn.tool_calls     # ParsedTurn, as engine.parsers give it

SGLang never raises on a malformed call: a call it cannot read stays in the content as text. sglang-router does not
route these endpoints; they go to a server (one of the router's workers).
"""

from __future__ import annotations

import json
from typing import Any

from engine.backends.transport import HTTPServer
from engine.errors import ErrorClass
from engine.parsers.base import ParsedTurn, ToolCallText


async def read_turn(
    server: HTTPServer,
    text: str,
    *,
    tools: list[dict[str, Any]],
    tool_call_parser: str | None,
    reasoning_parser: str | None,
) -> ParsedTurn:
    """`text` (the model's turn, special tokens kept; the reasoning's opening tag prepended where the prompt
    opened it) as SGLang reads it. BackendError: the server refused a parser name (CLIENT) or failed."""
    reasoning, content = "", text
    if reasoning_parser is not None:
        where = "POST /separate_reasoning"
        body = {"text": text, "reasoning_parser": reasoning_parser}
        reply = server.json(where, await server.call("POST", "/separate_reasoning", body))
        reasoning, content = _field(server, where, reply, "reasoning_text"), _field(server, where, reply, "text")
    if tool_call_parser is None:
        return ParsedTurn(content, reasoning)
    where = "POST /parse_function_call"
    body = {"text": content, "tools": tools, "tool_call_parser": tool_call_parser}
    reply = server.json(where, await server.call("POST", "/parse_function_call", body))
    content = _field(server, where, reply, "normal_text")
    calls = reply.get("calls")
    if not isinstance(calls, list):
        raise server.error(ErrorClass.MALFORMED, where, "no list of calls in the reply", str(reply)[:500])
    return ParsedTurn(content, reasoning, tuple(_call(server, where, call) for call in calls))


def _field(server: HTTPServer, where: str, reply: Any, name: str) -> str:
    value = reply.get(name) if isinstance(reply, dict) else None
    if not isinstance(value, str):
        raise server.error(ErrorClass.MALFORMED, where, f"no {name} string in the reply", str(reply)[:500])
    return value


def _call(server: HTTPServer, where: str, call: Any) -> ToolCallText:
    """One of SGLang's `ToolCallItem`s (tool_index, name, parameters as a JSON string) as a call."""
    name = call.get("name") if isinstance(call, dict) else None
    parameters = call.get("parameters") if isinstance(call, dict) else None
    try:  # a call without arguments may have none written
        arguments = json.loads(parameters or "{}") if isinstance(parameters, str) else None
    except ValueError:
        arguments = None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise server.error(ErrorClass.MALFORMED, where, "a call without a name or an object of arguments", str(call))
    return ToolCallText(name, arguments)
