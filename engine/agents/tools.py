"""What the dialects share about a request's tools and stop strings: each API's tools as the function tools a
chat template renders, and the ones the policy cannot call (a provider's hosted tools) left out and counted.

    tools = chat_tools_of(request.tools, degraded)      # [{"type": "function", "function": {...}}, ...]
    degraded                                            # {"tool:web_search": 1}: left out of the prompt
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, PrivateAttr

from engine.agents.request import RequestError


class DialectRequest(BaseModel):
    """A request of one API, as its dialect reads it; what it had to leave out is counted in `degraded()`."""

    _degraded: dict[str, int] = PrivateAttr(default_factory=dict)

    def degraded(self) -> dict[str, int]:
        """What of the request the policy cannot take, left out of its prompt: kind -> count."""
        return self._degraded

    def leave_out(self, kind: str) -> None:
        self._degraded[kind] = self._degraded.get(kind, 0) + 1


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """One tool as chat templates take it; RequestError where its name or schema is not one."""
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: a tool needs a name", param=where)
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"{where}: a tool's parameters are a JSON schema (an object)", param=where)
    function: dict[str, Any] = {"name": name, "description": description if isinstance(description, str) else ""}
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def chat_tools_of(tools: list[Any] | None, request: DialectRequest) -> list[dict[str, Any]] | None:
    """Chat Completions' tools: function tools as they are; any other kind left out and counted."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}] is not an object", param=f"tools.{i}")
        if tool.get("type", "function") != "function":
            request.leave_out(f"tool:{tool.get('type')}")
            continue
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"tools[{i}] is a function tool without its function", param=f"tools.{i}")
        out.append(
            function_tool(function.get("name"), function.get("description"), function.get("parameters"), f"tools[{i}]")
        )
    return out or None


def stop_strings(stop: Any) -> tuple[str, ...]:
    """A request's stop strings (one, or a list), empty ones left out."""
    if stop is None:
        return ()
    given = [stop] if isinstance(stop, str) else stop
    if not isinstance(given, list) or not all(isinstance(s, str) for s in given):
        raise RequestError("stop: a string or a list of strings", param="stop")
    return tuple(s for s in given if s)
