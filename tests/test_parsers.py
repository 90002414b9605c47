"""The output parsers: each family's documented turns (tests/parser_outputs.py, which cites the documentation)
parse to their content, reasoning and calls; each malformed variant is one MalformedCall of its kind;
`format_call` round-trips through `parse`; the current parser is a context variable; and the tool envs parse
calls in the family that runs."""

from __future__ import annotations

import contextvars

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from engine.envs.python_tool import PYTHON_TOOL
from engine.envs.tool_calls import MalformedToolCall, Tool, ToolCall, parse_tool_calls
from engine.parsers import (
    PARSERS,
    Malformed,
    MalformedCall,
    ParsedTurn,
    ToolCallText,
    current_parser,
    get_parser,
    reasoning_open,
    use_parser,
)
from tests.parser_outputs import DOCUMENTED, TOOLS


@pytest.mark.parametrize("case", DOCUMENTED, ids=lambda case: case.id)
def test_a_documented_turn_parses_as_its_documentation_shows(case):
    assert get_parser(case.family).parse(case.text, tools=TOOLS, in_reasoning=case.in_reasoning) == case.expected


def test_every_family_has_each_documented_case():
    assert {case.family for case in DOCUMENTED} == set(PARSERS)
    for family in PARSERS:
        cases = {case.case for case in DOCUMENTED if case.family == family}
        assert {"plain", "content-call"} <= cases and any(case.startswith("parallel") for case in cases), family


# -- malformed turns: the first mistake, as one MalformedCall of its kind ---------------------------------

QWEN_CALL = '{"name": "get_weather", "arguments": {"city": "Beijing"}}'
KIMI, DEEPSEEK = get_parser("kimi_k2"), get_parser("deepseekv31")
HARMONY = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


def qwen(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def coder(inner: str, name: str = "get_weather") -> str:
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


def parameter(key: str, value: str) -> str:
    return f"<parameter={key}>\n{value}\n</parameter>\n"


def glm(inner: str, name: str = "get_weather") -> str:
    return f"<tool_call>{name}\n{inner}</tool_call>"


def pair(key: str, value: str) -> str:
    return f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"


def sectioned(parser, head: str, arguments: str, *, close: bool = True) -> str:
    """One call in a Kimi-K2 or DeepSeek section; the section left open unless `close`."""
    (begin, end), (call, call_end) = parser.section, parser.call
    return f"{begin}{call}{head}{parser.separator}{arguments}{call_end}{end if close else ''}"


def kimi(head: str, arguments: str, *, close: bool = True) -> str:
    return sectioned(KIMI, head, arguments, close=close)


CITY = '{"city": "Beijing"}'
KIMI_ID = "functions.get_weather:0"
PAYMENT = '{"name": "retrieve_payment_status", "arguments": {"transaction_id": "T1001"}}'

# family, case, turn, kind (None: no call at all, the turn is content)
MALFORMED = [
    ("qwen25", "unclosed", f"<tool_call>\n{QWEN_CALL}", Malformed.NO_CLOSING_TAG),
    ("qwen25", "truncated", '<tool_call>\n{"name": "get_weather", "argu', Malformed.NO_CLOSING_TAG),
    ("qwen25", "bad-json", qwen(QWEN_CALL[:-1]), Malformed.INVALID_JSON),
    ("qwen25", "no-name", qwen('{"arguments": {"city": "Beijing"}}'), Malformed.NO_NAME),
    ("qwen25", "unknown-structure", qwen('["get_weather", {"city": "Beijing"}]'), Malformed.NOT_AN_OBJECT),
    ("qwen25", "call-in-unclosed-reasoning", "<think>\nI could <tool_call> this", Malformed.NO_CLOSING_TAG),
    (
        "qwen3_coder",
        "unclosed",
        coder(parameter("city", "Beijing")).removesuffix("\n</tool_call>"),
        Malformed.NO_CLOSING_TAG,
    ),
    (
        "qwen3_coder",
        "truncated",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBei",
        Malformed.NO_CLOSING_TAG,
    ),
    ("qwen3_coder", "unclosed-parameter", coder("<parameter=city>\nBeijing\n"), Malformed.NO_CLOSING_TAG),
    (
        "qwen3_coder",
        "unclosed-function",
        qwen("<function=get_weather>\n" + parameter("city", "B")),
        Malformed.NO_CLOSING_TAG,
    ),
    ("qwen3_coder", "no-name", coder("", name=""), Malformed.NO_NAME),
    ("qwen3_coder", "unknown-structure", qwen(QWEN_CALL), Malformed.UNEXPECTED_TEXT),
    ("qwen3_coder", "text-between-parameters", coder("city: Beijing\n"), Malformed.UNEXPECTED_TEXT),
    ("qwen3_coder", "duplicate", coder(parameter("city", "A") + parameter("city", "B")), Malformed.DUPLICATE_KEY),
    ("qwen3_coder", "not-an-integer", coder(parameter("days", "three")), Malformed.INVALID_VALUE),
    ("qwen3_coder", "function-outside", "<function=get_weather>\n</function>", Malformed.NO_OPENING_TAG),
    ("glm45", "unclosed", glm(pair("city", "Beijing")).removesuffix("</tool_call>"), Malformed.NO_CLOSING_TAG),
    ("glm45", "unclosed-value", glm("<arg_key>city</arg_key>\n<arg_value>Beijing\n"), Malformed.NO_CLOSING_TAG),
    ("glm45", "no-name", glm(pair("city", "Beijing"), name=""), Malformed.NO_NAME),
    ("glm45", "json-inside", f"<tool_call>{QWEN_CALL}</tool_call>", Malformed.NO_NAME),
    ("glm45", "unknown-structure", glm("city=Beijing\n"), Malformed.UNEXPECTED_TEXT),
    ("glm45", "key-without-value", glm("<arg_key>city</arg_key>\n"), Malformed.UNEXPECTED_TEXT),
    ("glm45", "not-an-integer", glm(pair("days", "three")), Malformed.INVALID_VALUE),
    ("glm47", "truncated", "<tool_call>get_weather<arg_key>city</arg_key><arg_val", Malformed.NO_CLOSING_TAG),
    ("glm47", "unclosed-key", glm("<arg_key>city<arg_value>Beijing</arg_value>"), Malformed.NO_CLOSING_TAG),
    ("glm47", "no-name", "<tool_call><arg_key>city</arg_key><arg_value>B</arg_value></tool_call>", Malformed.NO_NAME),
    ("glm47", "empty", "<tool_call></tool_call>", Malformed.EMPTY_CALL),
    ("kimi_k2", "unclosed-section", kimi(KIMI_ID, CITY, close=False), Malformed.NO_CLOSING_TAG),
    (
        "kimi_k2",
        "truncated",
        kimi(KIMI_ID, CITY, close=False).removesuffix("<|tool_call_end|>"),
        Malformed.NO_CLOSING_TAG,
    ),
    ("kimi_k2", "bad-json", kimi(KIMI_ID, '{"city": Beijing}'), Malformed.INVALID_JSON),
    ("kimi_k2", "bare-counter-id", kimi("0", CITY), Malformed.NO_NAME),
    ("kimi_k2", "no-separator", kimi(KIMI_ID, CITY).replace(KIMI.separator, ""), Malformed.NO_SEPARATOR),
    (
        "kimi_k2",
        "unknown-structure",
        f"{KIMI.section[0]}get_weather(city='B'){KIMI.section[1]}",
        Malformed.UNEXPECTED_TEXT,
    ),
    ("kimi_k2", "call-outside-section", kimi(KIMI_ID, CITY).removeprefix(KIMI.section[0]), Malformed.NO_OPENING_TAG),
    ("kimi_k2", "nested", kimi(f"{KIMI_ID}{KIMI.call[0]}{KIMI_ID}", "{}"), Malformed.NESTED_CALL),
    ("kimi_k2", "arguments-a-list", kimi(KIMI_ID, '["Beijing"]'), Malformed.ARGUMENTS_NOT_AN_OBJECT),
    ("gpt-oss", "truncated-arguments", HARMONY + '{"city": "Bei', Malformed.INVALID_JSON),
    ("gpt-oss", "truncated-header", HARMONY.removesuffix("json<|message|>"), Malformed.NO_CLOSING_TAG),
    ("gpt-oss", "bad-json", HARMONY + '{"city": Beijing}<|call|>', Malformed.INVALID_JSON),
    ("gpt-oss", "no-name", HARMONY.replace("functions.get_weather", "functions.") + "{}", Malformed.NO_NAME),
    ("gpt-oss", "unknown-channel", "<|channel|>thoughts<|message|>hmm<|end|>", Malformed.UNKNOWN_CHANNEL),
    ("gpt-oss", "arguments-a-list", HARMONY + '["Beijing"]<|call|>', Malformed.ARGUMENTS_NOT_AN_OBJECT),
    ("gpt-oss", "no-arguments", HARMONY + "<|call|>", Malformed.ARGUMENTS_NOT_AN_OBJECT),
    (
        "deepseekv31",
        "unclosed-section",
        sectioned(DEEPSEEK, "get_weather", CITY, close=False),
        Malformed.NO_CLOSING_TAG,
    ),
    (
        "deepseekv31",
        "truncated",
        sectioned(DEEPSEEK, "get_weather", CITY, close=False).removesuffix(DEEPSEEK.call[1])[:-4],
        Malformed.NO_CLOSING_TAG,
    ),
    ("deepseekv31", "bad-json", sectioned(DEEPSEEK, "get_weather", "{city: Beijing}"), Malformed.INVALID_JSON),
    ("deepseekv31", "no-name", sectioned(DEEPSEEK, "", CITY), Malformed.NO_NAME),
    (
        "deepseekv31",
        "no-separator",
        sectioned(DEEPSEEK, "get_weather", "").replace(DEEPSEEK.separator, ""),
        Malformed.NO_SEPARATOR,
    ),
    ("deepseekv31", "unknown-structure", "get_weather: Beijing".join(DEEPSEEK.section), Malformed.UNEXPECTED_TEXT),
    ("deepseekv31", "empty-section", "".join(DEEPSEEK.section), Malformed.EMPTY_CALL),
    (
        "llama3",
        "truncated",
        '{"name": "get_current_conditions", "parameters": {"location": "San Fr',
        Malformed.INVALID_JSON,
    ),
    ("llama3", "no-name", '{"parameters": {"location": "Boston"}}', Malformed.NO_NAME),
    ("llama3", "unexpected-key", '{"name": "get_weather", "parameters": {}, "id": 7}', Malformed.UNEXPECTED_KEY),
    ("llama3", "both-argument-keys", '{"name": "x", "parameters": {}, "arguments": {}}', Malformed.UNEXPECTED_KEY),
    ("llama3", "unknown-structure", '<|python_tag|>brave_search.call(query="weather")', Malformed.INVALID_JSON),
    (
        "llama3",
        "parameters-a-list",
        '{"name": "get_weather", "parameters": ["Beijing"]}',
        Malformed.ARGUMENTS_NOT_AN_OBJECT,
    ),
    ("llama3", "duplicate-key", '{"name": "get_weather", "name": "x", "parameters": {}}', Malformed.DUPLICATE_KEY),
    ("mistral", "truncated", f"[TOOL_CALLS] [{PAYMENT[:-20]}", Malformed.INVALID_JSON),
    ("mistral", "no-name", '[TOOL_CALLS] [{"arguments": {"transaction_id": "T1001"}}]', Malformed.NO_NAME),
    ("mistral", "unknown-structure", '[TOOL_CALLS] ["retrieve_payment_status"]', Malformed.NOT_AN_OBJECT),
    ("mistral", "empty-list", "[TOOL_CALLS] []", Malformed.EMPTY_CALL),
    ("mistral", "nothing-after-marker", "[TOOL_CALLS]", Malformed.EMPTY_CALL),
    ("mistral", "no-marker", 'retrieve_payment_status {"transaction_id": "T1001"}', None),
    (
        "mistral",
        "compact-no-separator",
        '[TOOL_CALLS]retrieve_payment_status{"transaction_id": "T1"}',
        Malformed.NO_SEPARATOR,
    ),
    ("mistral", "compact-no-name", '[TOOL_CALLS][ARGS]{"transaction_id": "T1001"}', Malformed.NO_NAME),
    (
        "mistral",
        "compact-arguments-a-list",
        '[TOOL_CALLS]get_weather[ARGS]["Beijing"]',
        Malformed.ARGUMENTS_NOT_AN_OBJECT,
    ),
]


@pytest.mark.parametrize(
    ("family", "text", "kind"), [c[:1] + c[2:] for c in MALFORMED], ids=[f"{c[0]}-{c[1]}" for c in MALFORMED]
)
def test_a_malformed_turn_is_one_malformed_call_of_its_kind(family, text, kind):
    parser = get_parser(family)
    if kind is None:
        assert parser.parse(text, tools=TOOLS) == ParsedTurn(text)
        return
    with pytest.raises(MalformedCall) as raised:
        parser.parse(text, tools=TOOLS)
    assert raised.value.kind == kind
    assert raised.value.number == 1 and raised.value.detail


def test_every_family_has_each_kind_of_malformed_turn():
    families = {case[0] for case in MALFORMED}
    assert families == set(PARSERS)
    kinds = {case[3] for case in MALFORMED} - {None}  # None: a case that is no mistake in that family
    judged_by_tools = {  # parse_tool_calls finds these, not a parser: tests/test_tool_calls.py has each
        Malformed.UNKNOWN_TOOL, Malformed.MISSING_ARGUMENT, Malformed.UNEXPECTED_ARGUMENT,
        Malformed.WRONG_ARGUMENT_TYPE, Malformed.INVALID_ARGUMENT, Malformed.TOO_MANY_CALLS,
    }  # fmt: skip
    assert kinds == set(Malformed) - judged_by_tools, set(Malformed) - kinds


def test_the_number_is_the_call_that_is_wrong():
    text = '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": 1}]'
    with pytest.raises(MalformedCall) as raised:
        get_parser("mistral").parse(text)
    assert (raised.value.kind, raised.value.number, raised.value.name) == (Malformed.ARGUMENTS_NOT_AN_OBJECT, 2, "b")
    second = "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>x</arg_value>\n</tool_call>"
    with pytest.raises(MalformedCall) as raised:
        get_parser("glm45").parse("<tool_call>get_weather\n</tool_call>" + second, tools=TOOLS)
    assert (raised.value.number, raised.value.name) == (2, "get_weather")
    assert "'days'" in raised.value.detail  # the argument is named


# -- reasoning ----------------------------------------------------------------------------------------


def test_reasoning_opened_by_the_prompt_runs_to_think_close_or_the_end():
    qwen = get_parser("qwen25")
    assert qwen.parse("still thinking", in_reasoning=True) == ParsedTurn("", "still thinking")
    assert qwen.parse("still thinking", in_reasoning=False) == ParsedTurn("still thinking")
    assert qwen.parse("hmm</think>\n\nHi.", in_reasoning=True) == ParsedTurn("Hi.", "hmm")
    assert qwen.parse("<think>\nhmm\n</think>\n\nHi.", in_reasoning=True) == ParsedTurn("Hi.", "hmm")  # re-opened


def test_a_call_opened_inside_reasoning_ends_it_as_sglang_reads_qwen3_glm_and_kimi():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beijing"}}\n</tool_call>'
    turn = get_parser("qwen25").parse(f"I need the weather.\n{call}", in_reasoning=True)
    assert turn == ParsedTurn("", "I need the weather.", (ToolCallText("get_weather", {"city": "Beijing"}),))


def test_harmony_reasoning_is_the_analysis_channel_and_plain_text_is_content():
    harmony = get_parser("gpt-oss")
    assert harmony.parse("<|channel|>analysis<|message|>Thinking, cut off at max tokens") == ParsedTurn(
        "", "Thinking, cut off at max tokens"
    )
    assert harmony.parse("Just text.", in_reasoning=True) == ParsedTurn("Just text.")
    assert harmony.parse("<|channel|>final<|message|>42") == ParsedTurn("42")  # <|return|> stripped


# -- argument values written as text, decoded by the tool's schema ---------------------------------------

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
    "tags": {"type": "array"}, "since": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "mode": {"enum": ["fast", "deep"]}, "note": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
}}}}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_coder", "glm45", "glm47"])
def test_bare_text_values_are_decoded_by_their_declared_type(family):
    parser = get_parser(family)
    written = {"query": "42", "limit": 5, "exact": True, "tags": ["a", 1], "since": None, "mode": "fast", "note": "x y"}
    text = parser.format_call("search", written).replace('"fast"', "fast")
    assert parser.parse(text, tools=[SEARCH]).tool_calls == (ToolCallText("search", written),)
    # without a schema, a value that is JSON is decoded, else kept as text
    assert parser.parse(text).tool_calls[0].arguments == written | {"query": 42}
    with pytest.raises(MalformedCall) as raised:
        parser.parse(parser.format_call("search", {"limit": "five"}), tools=[SEARCH])
    assert raised.value.kind == Malformed.INVALID_VALUE and "'limit'" in raised.value.detail


# -- format_call round-trips through parse ------------------------------------------------------------

_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object"}
_TEXT = st.text(st.characters(blacklist_characters="<>[]|｜▁", blacklist_categories=("Cs",)), max_size=12)
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT
_VALUES = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=6
)
_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)


def schema_of(name: str, arguments: dict) -> dict:
    properties = {key: {"type": _JSON_TYPES.get(type(value), "null")} for key, value in arguments.items()}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


@pytest.mark.parametrize("family", sorted(PARSERS))
@settings(max_examples=60, deadline=None)
@given(name=_NAMES, arguments=st.dictionaries(_NAMES, _VALUES, max_size=4), index=st.integers(0, 9))
def test_parse_gives_back_the_call_format_call_writes(family, name, arguments, index):
    parser = get_parser(family)
    call_id = f"functions.{name}:{index}" if family == "kimi_k2" else None
    text = parser.format_call(name, arguments, index=index)
    # XML-valued formats need the schema to tell "42" from 42; the others carry JSON and need none
    tools = [schema_of(name, arguments)] if family in ("qwen3_coder", "glm45", "glm47") else None
    assert parser.parse(text, tools=tools).tool_calls == (ToolCallText(name, arguments, call_id),)


@pytest.mark.parametrize("family", sorted(set(PARSERS) - {"llama3"}))  # Llama's <|python_tag|> is optional
def test_a_call_whose_delimiters_a_decoder_dropped_is_no_call(family):
    """Why the engine checks `delimiters` against the tokenizer's special tokens (skip_special_tokens)."""
    parser = get_parser(family)
    written = parser.format_call("get_weather", {"city": "Beijing"})
    for marker in parser.delimiters:
        written = written.replace(marker, "")
    assert parser.parse(written).tool_calls == ()


# -- the current parser --------------------------------------------------------------------------------


def test_the_current_parser_is_qwen25_unless_a_block_sets_another():
    assert current_parser() is PARSERS["qwen25"]
    with use_parser("glm45") as parser:
        assert current_parser() is parser is PARSERS["glm45"]
        with use_parser(PARSERS["kimi_k2"]):
            assert current_parser().name == "kimi_k2"
        assert current_parser().name == "glm45"
        assert contextvars.copy_context().run(current_parser).name == "glm45"
    assert current_parser().name == "qwen25"
    with pytest.raises(RuntimeError), use_parser("mistral"):
        raise RuntimeError("the block fails")
    assert current_parser().name == "qwen25"


def test_an_unknown_parser_name_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="no output parser 'hermes2'.*glm45.*qwen25"):
        get_parser("hermes2")
    with pytest.raises(ValueError), use_parser("qwen"):
        pass


# -- the tool envs parse calls in the family that runs ---------------------------------------------------


class WeatherArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str
    days: int = 1


WEATHER = Tool("get_weather", "The weather in a city.", WeatherArguments, example={"city": "Paris"})


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_parse_tool_calls_reads_the_current_familys_calls(family):
    parser = get_parser(family)
    reply = "Let me check.\n" + parser.format_call("get_weather", {"city": "Beijing", "days": 3})
    if family == "llama3":
        reply = parser.format_call("get_weather", {"city": "Beijing", "days": 3})
    with use_parser(family):
        assert parse_tool_calls(reply, [WEATHER]) == [ToolCall("get_weather", {"city": "Beijing", "days": 3})]
        assert WEATHER.example_call() == parser.format_call("get_weather", {"city": "Paris"})
    assert parse_tool_calls(reply, [WEATHER], parser=parser) == [
        ToolCall("get_weather", {"city": "Beijing", "days": 3})
    ]


def test_markers_in_the_reasoning_a_prompt_opened_are_no_call():
    """Qwen3-Thinking's and GLM-4.7's generation prompts open `<think>`: the text the env reads starts inside
    the reasoning, where the model may well write `</tool_call>` or a section marker while thinking."""
    call = get_parser("qwen25").format_call("get_weather", {"city": "Paris"})
    reply = f"I must close with </tool_call> after the JSON.</think>\n\n{call}"
    with use_parser("qwen25"), pytest.raises(MalformedToolCall):
        parse_tool_calls(reply, [WEATHER])  # read as content: a stray closing tag
    with use_parser("qwen25", in_reasoning=True):
        assert reasoning_open()
        assert parse_tool_calls(reply, [WEATHER]) == [ToolCall("get_weather", {"city": "Paris", "days": 1})]
    assert not reasoning_open()
    assert parse_tool_calls(reply, [WEATHER], in_reasoning=True) == [
        ToolCall("get_weather", {"city": "Paris", "days": 1})
    ]


def test_a_malformed_call_shows_the_model_an_example_in_its_own_format():
    reply = "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n</tool_call>"
    with use_parser("glm45"), pytest.raises(MalformedToolCall) as raised:
        parse_tool_calls(reply, [WEATHER, PYTHON_TOOL])
    error = raised.value
    assert error.kind == "invalid_value" and "'days'" in error.detail
    example = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    assert error.observation.endswith(f"A well-formed call:\n{example}")  # only the tool named


def test_validation_after_parsing_is_the_same_for_every_family():
    for family, reply in [
        ("kimi_k2", kimi("functions.get_weather:0", '{"city": "Beijing", "days": "3"}')),
        ("glm47", get_parser("glm47").format_call("get_weather", {"city": "Beijing", "days": '"3"'})),
    ]:
        with pytest.raises(MalformedToolCall) as raised:
            parse_tool_calls(reply, [WEATHER], parser=get_parser(family))
        assert raised.value.kind == "wrong_argument_type", family
    with pytest.raises(MalformedToolCall) as raised:
        parse_tool_calls(kimi("functions.bash:0", "{}"), [WEATHER], parser=get_parser("kimi_k2"))
    assert raised.value.kind == "unknown_tool"
    with pytest.raises(MalformedToolCall) as raised:
        parse_tool_calls(kimi("0", "{}"), [WEATHER], parser=get_parser("kimi_k2"))
    assert raised.value.kind == "no_name" and "functions.<name>:<index>" in raised.value.observation
