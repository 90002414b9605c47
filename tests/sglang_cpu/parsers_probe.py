"""TEST INFRASTRUCTURE, run by the SGLang venv's python (tests/test_parsers_vs_sglang.py): SGLang's own parsers
on model turns, as its OpenAI server applies them (the reasoning parser first, then the tool-call parser on the
text it leaves). Reads a JSON list of cases on stdin, each {"parser", "reasoning_parser" (or null),
"force_reasoning", "text", "tools"}; writes one JSON list of {"reasoning", "content", "calls": [{"name",
"arguments"}]} on stdout."""

from __future__ import annotations

import json
import logging
import sys

from sglang.srt.entrypoints.openai.protocol import Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.parser.reasoning_parser import ReasoningParser


def parse(case: dict) -> dict:
    reasoning, text = None, case["text"]
    if case["reasoning_parser"]:
        reasoning_parser = ReasoningParser(
            model_type=case["reasoning_parser"], stream_reasoning=False, force_reasoning=case["force_reasoning"]
        )
        reasoning, text = reasoning_parser.parse_non_stream(text)
    tools = [Tool.model_validate(tool) for tool in case["tools"]]
    content, calls = FunctionCallParser(tools=tools, tool_call_parser=case["parser"]).parse_non_stream(text)
    found = [{"name": call.name, "arguments": json.loads(call.parameters or "{}")} for call in calls]
    return {"reasoning": reasoning or "", "content": content or "", "calls": found}


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)  # SGLang logs the calls it drops; the answer says what it kept
    json.dump([parse(case) for case in json.load(sys.stdin)], sys.stdout)
