"""A family's call syntax read off its chat template (engine/probe.py, engine/parsers/probed.py): on the official
templates in tests/fixtures, a probed layout reads what the engine's own hand-written parser of that family reads
(its documented turns, and the calls it writes), writes calls its template would write, and reads them back; the
templates of families the engine has no parser for get one where the template's syntax has a layout, and a named
reason where it has not."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.encoding import ChatEncoder
from engine.parsers import MalformedCall, ParsedTurn
from engine.parsers.probed import NoCallSyntax, ProbedParser
from engine.probe import probe_layout, reasoning_markers, written
from tests.family_fixtures import NAMES, family_tokenizer
from tests.parser_outputs import DOCUMENTED, TOOLS

# What the probe finds on each template of a family the engine has no parser for.
UNKNOWN = {
    "MiniMaxAI-MiniMax-M2.7": None,  # `<minimax:tool_call>\n<invoke name=...>\n<parameter name=...>`: found
    # `<kcharlie>vecho</kcharlie>`: each argument closes with a tag named after it, which no layout holds
    "MiniMaxAI-MiniMax-M3": "does not read the template's own call back",
    "google-gemma-3-4b-it": "the template writes no structured tool calls",
    "inclusionAI-Ling-3.0-flash": None,  # GLM's `<tool_call>NAME<arg_key>...<arg_value>...`: found
    "openbmb-MiniCPM5-1B": None,  # `<function name=...><param name=...>`: found
}


def probed(name: str) -> ChatEncoder:
    return ChatEncoder(family_tokenizer(name))


def layouts() -> list[str]:
    """The fixtures whose family the engine knows and whose template the probe reads (10 of 15)."""
    found = []
    for name in NAMES:
        encoder = probed(name)
        if encoder.family is not None and probe_layout(encoder)[0] is not None:
            found.append(name)
    return found


@pytest.mark.parametrize("name", sorted(UNKNOWN))
def test_a_family_without_a_parser_gets_one_read_off_its_template_or_a_reason(name):
    encoder = probed(name)
    assert encoder.family is None
    if UNKNOWN[name] is None:
        assert isinstance(encoder.parser, ProbedParser) and encoder.parser_problem is None
        encoder.check_env("calc", ("user", "tool"), skip_special_tokens=False)  # a tool env runs on it
    else:
        assert encoder.parser is None and UNKNOWN[name] in encoder.parser_problem
        refusal = "its call syntax cannot be read off it" if encoder.role_problem("tool") is None else "roles must"
        with pytest.raises(ValueError, match=refusal):
            encoder.check_env("calc", ("user", "tool"), skip_special_tokens=False)


KNOWN_PROBED = [
    "Qwen-Qwen3-4B-Thinking-2507", "Qwen-Qwen3-Coder-30B-A3B-Instruct", "Qwen-Qwen3.5-4B", "deepseek-ai-DeepSeek-V3.1",
    "mistralai-Devstral-Small-2-24B-Instruct-2512", "stepfun-ai-Step-3.5-Flash", "zai-org-GLM-4.6V-Flash",
    "zai-org-GLM-4.7-Flash", "zai-org-GLM-5.1",
]  # fmt: skip


def test_the_probe_reads_the_templates_of_most_known_families():
    assert layouts() == KNOWN_PROBED


@pytest.mark.parametrize("name", KNOWN_PROBED)
def test_a_probed_layout_reads_what_the_familys_own_parser_reads(name):
    """The engine's hand-written parser of the family against the layout read off its template, knowing nothing of
    it: the documented turns of the family (tests/parser_outputs.py) with calls, and the calls the family writes."""
    encoder = probed(name)
    layout, _ = probe_layout(encoder)
    parser, own = ProbedParser(layout), encoder.family.parser
    cases = [case for case in DOCUMENTED if case.family == own.name and case.expected.tool_calls]
    for case in cases:
        try:
            read = parser.parse(case.text, tools=TOOLS, in_reasoning=case.in_reasoning)
        except MalformedCall:
            continue  # a documented form the template does not write (a call with text after it, say)
        assert [(c.name, c.arguments) for c in read.tool_calls] == [
            (c.name, c.arguments) for c in case.expected.tool_calls
        ], case.id
    for arguments in ({"city": "Paris"}, {"city": "Paris", "days": 3}, {}):  # calls as the template writes them
        structured = encoder.tool_call(encoder.family.call_id("get_weather", 0), "get_weather", arguments)
        text = written(encoder, {"role": "assistant", "content": "", "tool_calls": [structured]})
        ours, theirs = parser.parse(text), own.parse(text, in_reasoning=encoder.opens_reasoning)
        assert [(c.name, c.arguments) for c in ours.tool_calls] == [(c.name, c.arguments) for c in theirs.tool_calls]
        assert [c.name for c in ours.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("name", [n for n, problem in UNKNOWN.items() if problem is None])
@settings(max_examples=60, deadline=None)
@given(
    tool=st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True),
    arguments=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True),
        st.one_of(
            st.integers(-(10**6), 10**6),
            st.booleans(),
            st.from_regex(r"[A-Za-z]([A-Za-z .,]{0,30}[a-z])?", fullmatch=True),
        ),
        max_size=4,
    ),
)
def test_a_probed_parser_reads_back_every_call_it_writes_as_its_template_does(name, tool, arguments):
    encoder = probed(name)
    parser = encoder.parser
    schema = [{"type": "function", "function": {"name": tool, "parameters": {"type": "object", "properties": {
        key: {"type": "string" if isinstance(value, str) else "boolean" if isinstance(value, bool) else "integer"}
        for key, value in arguments.items()
    }}}}]  # fmt: skip
    read = parser.parse(parser.format_call(tool, arguments), tools=schema)
    assert [(c.name, c.arguments) for c in read.tool_calls] == [(tool, arguments)]
    structured = encoder.tool_call("call00000", tool, arguments)  # as the template writes it, read by the parser
    text = written(encoder, {"role": "assistant", "content": "", "tool_calls": [structured]})
    assert [(c.name, c.arguments) for c in parser.parse(text, tools=schema).tool_calls] == [(tool, arguments)]


def test_a_malformed_call_is_named_and_a_probed_parser_travels_whole():
    parser = probed("openbmb-MiniCPM5-1B").parser
    with pytest.raises(MalformedCall) as raised:
        parser.parse('<function name="calc"><param name="answer">42</param>')
    assert raised.value.kind == "unexpected_text" and "the call's end" in raised.value.detail
    assert pickle.loads(pickle.dumps(parser)) == parser  # to Ray env workers, by value


@pytest.mark.parametrize("name", sorted(name for name, why in UNKNOWN.items() if why is not None))
def test_where_no_call_syntax_is_found_turns_are_read_by_the_template_alone_and_calls_refused_by_name(name):
    """No other family's syntax is tried: a Qwen-style call is text, and asking for calls names why none is read."""
    reader = probed(name).reader
    qwen_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with pytest.raises(NoCallSyntax, match=UNKNOWN[name]):
        reader.parse(qwen_call, tools=TOOLS)
    with pytest.raises(NoCallSyntax, match="name its family with model_family"):
        reader.format_call("get_weather", {"city": "Paris"})
    assert reader.parse(qwen_call) == ParsedTurn(qwen_call)
    markers = reasoning_markers(probed(name))
    if markers["reasoning_close"]:  # the reasoning by the template's own markers
        text = f"{markers['reasoning_open']}weigh it{markers['reasoning_close']}Sunny."
        assert reader.parse(text) == ParsedTurn("Sunny.", "weigh it")
    assert pickle.loads(pickle.dumps(reader)) == reader  # to Ray env workers, by value


def test_where_reasoning_starts_is_read_off_the_template_with_its_own_markers():
    """MiniMax-M3 reasons in `<mm:think>`, which its generation prompt opens only in its thinking mode: the turns
    then start inside the reasoning, and the reader splits it off by the template's markers (not `<think>`)."""
    thinking = ChatEncoder(family_tokenizer("MiniMaxAI-MiniMax-M3"), chat_template_kwargs={"thinking_mode": "enabled"})
    adaptive = ChatEncoder(family_tokenizer("MiniMaxAI-MiniMax-M3"), chat_template_kwargs={"thinking_mode": "adaptive"})
    assert thinking.reasoning_tags == adaptive.reasoning_tags == ("<mm:think>", "</mm:think>")
    assert (thinking.opens_reasoning, adaptive.opens_reasoning) == (True, False)
    turn = ParsedTurn("Sunny.", "weigh it")
    assert thinking.reader.parse("weigh it</mm:think>Sunny.", in_reasoning=True) == turn
    assert adaptive.reader.parse("<mm:think>weigh it</mm:think>Sunny.") == turn
