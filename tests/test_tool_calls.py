"""The shared tool-call parser: well-formed Qwen-style calls parse; each malformed call of
docs/envs/tool_calls.md raises its one typed error, whose observation tells the model what is wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from engine.envs.python_tool import PYTHON_TOOL
from engine.envs.tool_calls import Malformed, MalformedToolCall, Tool, ToolCall, parse_tool_calls

DOC = Path(__file__).resolve().parents[1] / "docs" / "envs" / "tool_calls.md"


class SearchArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str
    limit: int = 5


SEARCH = Tool("search", "Search the notes.", SearchArguments, example={"query": "primes"})
TOOLS = [PYTHON_TOOL, SEARCH]


def call(body: str) -> str:
    return f"Let me run it.\n<tool_call>\n{body}\n</tool_call>"


# id, reply, kind, the observation's detail (after "Tool call error (<kind>): ")
MALFORMED = [
    (
        "no-closing-tag",
        '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}',
        Malformed.NO_CLOSING_TAG,
        "<tool_call> is never closed with </tool_call>",
    ),
    (
        "no-opening-tag",
        '{"name": "python", "arguments": {"code": "1"}}\n</tool_call>',
        Malformed.NO_OPENING_TAG,
        "</tool_call> without a <tool_call> before it",
    ),
    (
        "nested-call",
        "<tool_call><tool_call>{}</tool_call></tool_call>",
        Malformed.NESTED_CALL,
        "a <tool_call> opens before the one before it is closed with </tool_call>",
    ),
    ("empty-call", "<tool_call>\n  \n</tool_call>", Malformed.EMPTY_CALL, "tool call 1 is empty"),
    (
        "invalid-json",
        call('{"name": "python", "arguments": {"code": "print(1)"}'),
        Malformed.INVALID_JSON,
        "tool call 1 is not valid JSON: Expecting ',' delimiter at line 1, column 53",
    ),
    (
        "single-quotes",
        call("{'name': 'python', 'arguments': {'code': '1'}}"),
        Malformed.INVALID_JSON,
        "tool call 1 is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2",
    ),
    (
        "duplicate-key",
        call('{"name": "python", "name": "search", "arguments": {}}'),
        Malformed.DUPLICATE_KEY,
        "tool call 1 gives the key 'name' twice",
    ),
    (
        "not-an-object",
        call('["python", {"code": "1"}]'),
        Malformed.NOT_AN_OBJECT,
        'tool call 1 is a list (["python", {"code": "1"}]), not an object {"name": ..., "arguments": ...}',
    ),
    (
        "no-name",
        call('{"arguments": {"code": "1"}}'),
        Malformed.NO_NAME,
        'tool call 1 has no "name" string naming the tool',
    ),
    (
        "unexpected-key",
        call('{"name": "python", "arguments": {"code": "1"}, "id": 7}'),
        Malformed.UNEXPECTED_KEY,
        'tool call 1 has \'id\'; a call has only "name" and "arguments"',
    ),
    (
        "unknown-tool",
        call('{"name": "bash", "arguments": {"cmd": "ls"}}'),
        Malformed.UNKNOWN_TOOL,
        "tool call 1 names the tool 'bash'; the tools are 'python', 'search'",
    ),
    (
        "no-arguments",
        call('{"name": "python"}'),
        Malformed.ARGUMENTS_NOT_AN_OBJECT,
        'tool call 1 has no "arguments"; give an object',
    ),
    (
        "arguments-not-an-object",
        call('{"name": "python", "arguments": ["print(1)"]}'),
        Malformed.ARGUMENTS_NOT_AN_OBJECT,
        'tool call 1 has a list (["print(1)"]) as its "arguments"; give an object',
    ),
    (
        "missing-argument",
        call('{"name": "python", "arguments": {}}'),
        Malformed.MISSING_ARGUMENT,
        "tool call 1 (python): the argument 'code' is missing (it takes: code)",
    ),
    (
        "unexpected-argument",
        call('{"name": "python", "arguments": {"code": "1", "timeout": 9}}'),
        Malformed.UNEXPECTED_ARGUMENT,
        "tool call 1 (python): 'timeout' is not an argument (it takes: code)",
    ),
    (
        "wrong-argument-type",
        call('{"name": "python", "arguments": {"code": 42}}'),
        Malformed.WRONG_ARGUMENT_TYPE,
        "tool call 1 (python): the argument 'code' must be a string, not a number (42)",
    ),
    (
        "number-as-string",
        call('{"name": "search", "arguments": {"query": "x", "limit": "3"}}'),
        Malformed.WRONG_ARGUMENT_TYPE,
        "tool call 1 (search): the argument 'limit' must be an integer, not a string (\"3\")",
    ),
    (
        "empty-code",
        call('{"name": "python", "arguments": {"code": "  \\n"}}'),
        Malformed.INVALID_ARGUMENT,
        "tool call 1 (python): the argument 'code': is empty: give the code to run",
    ),
    (
        "too-many-calls",
        call('{"name": "python", "arguments": {"code": "1"}}') * 2,
        Malformed.TOO_MANY_CALLS,
        "the reply makes 2 tool calls; make one tool call per reply",
    ),
]


@pytest.mark.parametrize(("reply", "kind", "detail"), [case[1:] for case in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_a_malformed_call_is_one_typed_error_with_its_observation(reply, kind, detail):
    with pytest.raises(MalformedToolCall) as raised:
        parse_tool_calls(reply, TOOLS)
    error = raised.value
    assert (error.kind, error.detail) == (kind, detail)
    assert error.observation.startswith(f"Tool call error ({kind}): {detail}.\nA well-formed call:\n<tool_call>\n")
    assert error.observation.rstrip().endswith("</tool_call>")  # the example call the model can copy


def test_the_docs_table_lists_every_malformed_call_and_its_observation():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    documented = {re.match(r"\| `([^`]+)`", row).group(1): row for row in rows}
    assert documented.keys() == {case[0] for case in MALFORMED}
    for case_id, _, kind, detail in MALFORMED:
        assert f"`{kind}`" in documented[case_id] and detail.replace("|", "\\|") in documented[case_id], case_id
    # every kind is tested: here those of Qwen2.5's form and the tools', in tests/test_parsers.py the others
    other_forms = {
        Malformed.NO_SEPARATOR, Malformed.UNEXPECTED_TEXT, Malformed.INVALID_VALUE, Malformed.UNKNOWN_CHANNEL,
    }  # fmt: skip
    assert {str(kind) for kind in set(Malformed) - other_forms} == {str(case[2]) for case in MALFORMED}


def test_well_formed_calls_parse_as_qwen_renders_them():
    reply = 'I will compute it.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    assert parse_tool_calls(reply, TOOLS) == [ToolCall("python", {"code": "print(6 * 7)"})]
    assert parse_tool_calls("The answer is <answer>42</answer>.", TOOLS) == []  # no call at all
    # arguments as JSON text (OpenAI style) are taken, and defaults filled in
    stringly = call('{"name": "search", "arguments": "{\\"query\\": \\"primes\\"}"}')
    assert parse_tool_calls(stringly, TOOLS) == [ToolCall("search", {"query": "primes", "limit": 5})]
    two = call('{"name": "python", "arguments": {"code": "1"}}') + call(
        '{"name": "search", "arguments": {"query": "q"}}'
    )
    assert [c.name for c in parse_tool_calls(two, TOOLS, max_calls=None)] == ["python", "search"]


def test_the_tool_schema_is_what_the_chat_template_renders(tokenizer):
    schema = PYTHON_TOOL.schema()
    assert schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["required"] == ["code"]
    assert "title" not in schema["function"]["parameters"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[schema], tokenize=False)
    assert '"name": "python"' in text and "<tool_call>" in text
