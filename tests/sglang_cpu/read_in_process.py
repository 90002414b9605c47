"""TEST INFRASTRUCTURE, run by the SGLang venv's python with the repository on its path
(tests/test_sglang_read.py): the engine's in-process reader (engine/backends/sglang_read.py's InProcessParsers)
on model turns, with this venv's SGLang. Reads {"cases": [{"text", "tools", "tool_call_parser", "reasoning_parser"}],
"names": [...]} on stdin; writes {"readings": [...], "here": {name: bool}} on stdout: each reading {"reasoning",
"content", "calls": [{"name", "arguments"}]} or {"error_class", "message"}, and for each name whether the reader
takes it in process (`InProcessParsers.here`)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

from engine.backends.sglang_read import InProcessParsers
from engine.errors import BackendError


async def read(parsers: InProcessParsers, case: dict) -> dict:
    names = {"tool_call_parser": case["tool_call_parser"], "reasoning_parser": case["reasoning_parser"]}
    try:
        turn = await parsers.read_turn(case["text"], tools=case["tools"], **names)
    except BackendError as exc:
        return {"error_class": exc.error_class.value, "message": exc.message}
    calls = [{"name": call.name, "arguments": call.arguments} for call in turn.tool_calls]
    return {"reasoning": turn.reasoning, "content": turn.content, "calls": calls}


async def main() -> dict:
    asked = json.load(sys.stdin)
    parsers = InProcessParsers.here()
    if parsers is None:
        raise SystemExit("sglang is not importable here")
    here = {name: InProcessParsers.here(names=(name,)) is not None for name in asked["names"]}
    return {"readings": [await read(parsers, case) for case in asked["cases"]], "here": here}


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)  # SGLang logs the calls it drops; the answer says what it kept
    json.dump(asyncio.run(main()), sys.stdout)
