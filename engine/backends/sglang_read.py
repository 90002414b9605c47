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

import importlib.util
import json
from typing import Any

from engine.backends.transport import HTTPServer
from engine.errors import BackendError, ErrorClass
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


class InProcessParsers:
    """SGLang's parser classes in this process, where `sglang` is importable (slime's image, where slime's own agent
    path reads turns the same way, slime/agent/parsing.py): the reading the two endpoints above give, with no
    round trip and no server in the way. `read_turn` is the endpoints' (`ReasoningParser`, then
    `FunctionCallParser(...).parse_non_stream` on the text it leaves), with this process's SGLang."""

    name = "SGLang's parsers in this process"

    def __init__(self, tokenizer: Any = None):
        from sglang.srt.entrypoints.openai.chat_encoding_adapters import native_text_parser
        from sglang.srt.entrypoints.openai.protocol import Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        self._native, self._tool, self._calls, self._reasoning = (
            native_text_parser,
            Tool,
            FunctionCallParser,
            ReasoningParser,
        )
        self.tokenizer = tokenizer  # the served model's: the few detectors that read its vocabulary get it

    @staticmethod
    def here(tokenizer: Any = None, names: tuple[str | None, ...] = ()) -> InProcessParsers | None:
        """SGLang's parsers in this process, for the parser `names`; None where `sglang` cannot be imported here, or
        where one of the names is read with a served model's own encoding (DeepSeek-V4's), which only a server of
        that model has: those turns are read on the servers."""
        if importlib.util.find_spec("sglang") is None:
            return None
        try:
            parsers = InProcessParsers(tokenizer)
        except ImportError:  # an SGLang without these modules (older than the endpoints): read on the servers
            return None
        try:
            for name in names:
                if name is not None:
                    parsers._native(name, chat_encoding_spec=None, adapter=None)
        except ValueError:
            return None
        return parsers

    async def read_turn(
        self, text: str, *, tools: list[dict[str, Any]], tool_call_parser: str | None, reasoning_parser: str | None
    ) -> ParsedTurn:
        """`text` as the endpoints read it. BackendError: SGLang has no such parser (CLIENT), or its parser failed
        on this text (MALFORMED)."""
        try:
            separate = (
                self._reasoning(model_type=reasoning_parser, tokenizer=self.tokenizer) if reasoning_parser else None
            )
            schemas = [self._tool.model_validate(tool) for tool in tools]
            find = (
                self._calls(tools=schemas, tool_call_parser=tool_call_parser, tokenizer=self.tokenizer)
                if tool_call_parser
                else None
            )
        except ValueError as exc:  # SGLang's word for a parser it does not have (or a tool it cannot take)
            raise BackendError(ErrorClass.CLIENT, f"{self.name}: {exc}") from exc
        try:
            return self._read(text, separate, find)
        except Exception as exc:  # noqa: BLE001 -- SGLang's parser failed on this turn: the turn's error, not ours
            raise BackendError(ErrorClass.MALFORMED, f"{self.name}: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _read(text: str, separate: Any, find: Any) -> ParsedTurn:
        reasoning, content = "", text
        if separate is not None:
            found, rest = separate.parse_non_stream(text)
            reasoning, content = found or "", rest or ""
        if find is None:
            return ParsedTurn(content, reasoning)
        content, calls = find.parse_non_stream(content)
        read = []
        for call in calls:
            arguments = json.loads(call.parameters or "{}")
            if not isinstance(call.name, str) or not isinstance(arguments, dict):
                raise ValueError(f"a call without a name or an object of arguments: {call!r}")
            read.append(ToolCallText(call.name, arguments))
        return ParsedTurn(content or "", reasoning, tuple(read))
