"""Model turns as each family's own documentation shows them, with what each should parse to: read by
tests/test_parsers.py (our parsers) and tests/test_parsers_vs_sglang.py (SGLang's on the same text).

Where a family's documentation shows one call, the parallel and mixed cases repeat its markers the same way."""

from __future__ import annotations

from dataclasses import dataclass

from engine.parsers import ParsedTurn
from engine.parsers import ToolCallText as Call


def _tool(name: str, **properties: dict) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": f"The {name} tool.", "parameters": parameters},
    }


STRING, INTEGER = {"type": "string"}, {"type": "integer"}
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
TOOLS = [
    _tool("get_current_temperature", location=STRING, unit=UNIT),
    _tool("get_temperature_date", location=STRING, date=STRING, unit=UNIT),
    _tool("get_weather", city=STRING, days=INTEGER),
    _tool("get_current_weather", location=STRING, format=UNIT),
    _tool("get_current_conditions", location=STRING, unit=STRING),
    _tool("retrieve_payment_status", transaction_id=STRING),
]


@dataclass(frozen=True)
class Documented:
    family: str
    case: str
    text: str
    expected: ParsedTurn
    in_reasoning: bool = False

    @property
    def id(self) -> str:
        return f"{self.family}-{self.case}"


SF = "San Francisco, CA, USA"
TEMPERATURE = Call("get_current_temperature", {"location": SF})
TEMPERATURE_DATE = Call("get_temperature_date", {"location": SF, "date": "2024-10-01"})
BEIJING = Call("get_weather", {"city": "Beijing"})
SHANGHAI_3 = Call("get_weather", {"city": "Shanghai", "days": 3})

# Qwen's function-calling guide (qwen.readthedocs.io, framework/function_call, "Hermes-style tool use" and the
# vLLM example's raw outputs); Qwen3's thinking as in its model card ("Switching between thinking and non-thinking").
_QWEN_CALL_1 = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    "</tool_call>"
)
_QWEN_CALL_2 = (
    '<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01"}}\n</tool_call>'
)
QWEN25 = [
    Documented(
        "qwen25",
        "plain",
        "The current temperature in San Francisco is 26.1°C.",
        ParsedTurn("The current temperature in San Francisco is 26.1°C."),
    ),
    Documented(
        "qwen25",
        "reasoning",
        "<think>\nThe user asks for 2+2.\n</think>\n\n2 + 2 = 4.",
        ParsedTurn("2 + 2 = 4.", "The user asks for 2+2."),
    ),
    Documented("qwen25", "one-call", _QWEN_CALL_1, ParsedTurn("", "", (TEMPERATURE,))),
    Documented(
        "qwen25", "parallel", f"{_QWEN_CALL_1}\n{_QWEN_CALL_2}", ParsedTurn("", "", (TEMPERATURE, TEMPERATURE_DATE))
    ),
    Documented(
        "qwen25",
        "reasoning-call",
        f"<think>\nI need today's temperature.\n</think>\n\n{_QWEN_CALL_1}",
        ParsedTurn("", "I need today's temperature.", (TEMPERATURE,)),
    ),
    Documented(
        "qwen25",
        "content-call",
        f"Let me look that up.\n{_QWEN_CALL_1}",
        ParsedTurn("Let me look that up.", "", (TEMPERATURE,)),
    ),
    Documented(  # Qwen3-*-Thinking-2507: the template opens <think>, so the turn starts inside it
        "qwen25",
        "opened-reasoning-call",
        f"I need today's temperature.\n</think>\n\n{_QWEN_CALL_1}",
        ParsedTurn("", "I need today's temperature.", (TEMPERATURE,)),
        in_reasoning=True,
    ),
]

# Qwen3-Coder's chat template (huggingface.co/Qwen/Qwen3-Coder-30B-A3B-Instruct, chat_template.jinja: the tool
# instructions' example, a value spanning lines); Qwen3.5 thinks first in the same format.
_CODER_CALL_1 = (
    "<tool_call>\n<function=get_current_temperature>\n<parameter=location>\nSan Francisco, CA, USA\n</parameter>\n"
    "</function>\n</tool_call>"
)
_CODER_CALL_2 = (
    "<tool_call>\n<function=get_temperature_date>\n<parameter=location>\nSan Francisco, CA, USA\n</parameter>\n"
    "<parameter=date>\n2024-10-01\n</parameter>\n</function>\n</tool_call>"
)
_CODER_MULTILINE = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nThis is the value\nthat can span\nmultiple lines\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CODER = [
    Documented("qwen3_coder", "plain", "Done: the tests pass.", ParsedTurn("Done: the tests pass.")),
    Documented("qwen3_coder", "one-call", _CODER_CALL_1, ParsedTurn("", "", (TEMPERATURE,))),
    Documented(
        "qwen3_coder",
        "parallel",
        f"{_CODER_CALL_1}\n{_CODER_CALL_2}",
        ParsedTurn("", "", (TEMPERATURE, TEMPERATURE_DATE)),
    ),
    Documented(
        "qwen3_coder",
        "multiline-typed",
        _CODER_MULTILINE,
        ParsedTurn(
            "", "", (Call("get_weather", {"city": "This is the value\nthat can span\nmultiple lines", "days": 3}),)
        ),
    ),
    Documented(
        "qwen3_coder",
        "reasoning-call",
        f"<think>\nI need the temperature.\n</think>\n\n{_CODER_CALL_1}",
        ParsedTurn("", "I need the temperature.", (TEMPERATURE,)),
    ),
    Documented(
        "qwen3_coder",
        "content-call",
        f"I will check.\n{_CODER_CALL_1}",
        ParsedTurn("I will check.", "", (TEMPERATURE,)),
    ),
]

# GLM-4.5's chat template (huggingface.co/zai-org/GLM-4.5, chat_template.jinja: "output the function name and
# arguments within the following XML format"); GLM-4.7's (zai-org/GLM-4.7) writes the same without newlines.
_GLM45_BEIJING = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n</tool_call>"
_GLM45_SHANGHAI = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Shanghai</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
)
_GLM47_BEIJING = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>"
_GLM47_SHANGHAI = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Shanghai</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)


def _glm(family: str, beijing: str, shanghai: str) -> list[Documented]:
    return [
        Documented(family, "plain", "Beijing is sunny today.", ParsedTurn("Beijing is sunny today.")),
        Documented(
            family,
            "reasoning",
            "<think>The user greets me.</think>\nHello!",
            ParsedTurn("Hello!", "The user greets me."),
        ),
        Documented(family, "one-call", beijing, ParsedTurn("", "", (BEIJING,))),
        Documented(family, "parallel-typed", f"{beijing}\n{shanghai}", ParsedTurn("", "", (BEIJING, SHANGHAI_3))),
        Documented(
            family,
            "reasoning-call",
            f"<think>I need the weather in Beijing.</think>\n{beijing}",
            ParsedTurn("", "I need the weather in Beijing.", (BEIJING,)),
        ),
        Documented(family, "content-call", f"Let me check.\n{beijing}", ParsedTurn("Let me check.", "", (BEIJING,))),
    ]


GLM45 = _glm("glm45", _GLM45_BEIJING, _GLM45_SHANGHAI)
GLM47 = _glm("glm47", _GLM47_BEIJING, _GLM47_SHANGHAI)

# Kimi-K2's docs/tool_call_guidance.md (huggingface.co/moonshotai/Kimi-K2-Instruct, "Manually Parsing Tool
# Calls"); Kimi-K2-Thinking's model card for <think>.
_KIMI_BEIJING = (
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>'
)
_KIMI_SHANGHAI = (
    '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Shanghai", "days": 3}'
    "<|tool_call_end|>"
)
_KIMI_ONE = f"<|tool_calls_section_begin|>{_KIMI_BEIJING}<|tool_calls_section_end|>"
KIMI_K2 = [
    Documented("kimi_k2", "plain", "Beijing is sunny today.", ParsedTurn("Beijing is sunny today.")),
    Documented(
        "kimi_k2", "reasoning", "<think>The user greets me.</think>Hello!", ParsedTurn("Hello!", "The user greets me.")
    ),
    Documented(
        "kimi_k2",
        "one-call",
        _KIMI_ONE,
        ParsedTurn("", "", (Call("get_weather", {"city": "Beijing"}, "functions.get_weather:0"),)),
    ),
    Documented(
        "kimi_k2",
        "parallel",
        f"<|tool_calls_section_begin|>\n{_KIMI_BEIJING}\n{_KIMI_SHANGHAI}\n<|tool_calls_section_end|>",
        ParsedTurn(
            "",
            "",
            (
                Call("get_weather", {"city": "Beijing"}, "functions.get_weather:0"),
                Call("get_weather", {"city": "Shanghai", "days": 3}, "functions.get_weather:1"),
            ),
        ),
    ),
    Documented(
        "kimi_k2",
        "reasoning-call",
        f"<think>I need the weather.</think>{_KIMI_ONE}",
        ParsedTurn("", "I need the weather.", (Call("get_weather", {"city": "Beijing"}, "functions.get_weather:0"),)),
    ),
    Documented(
        "kimi_k2",
        "content-call",
        f"Let me check the weather.{_KIMI_ONE}",
        ParsedTurn(
            "Let me check the weather.", "", (Call("get_weather", {"city": "Beijing"}, "functions.get_weather:0"),)
        ),
    ),
]

# OpenAI's harmony guide (cookbook.openai.com/articles/openai-harmony: "Receiving tool calls", "Preambles",
# the chain-of-thought example); the turn starts after the prompt's <|start|>assistant.
_HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>"
    '{"location":"San Francisco"}<|call|>'
)
SF_WEATHER = Call("get_current_weather", {"location": "San Francisco"})
GPT_OSS = [
    Documented("gpt-oss", "plain", "<|channel|>final<|message|>2 + 2 = 4.<|return|>", ParsedTurn("2 + 2 = 4.")),
    Documented(
        "gpt-oss",
        "reasoning",
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
        ParsedTurn("2 + 2 = 4.", 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'),
    ),
    Documented(
        "gpt-oss",
        "reasoning-call",
        f"<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|>{_HARMONY_CALL}",
        ParsedTurn("", "Need to use function get_current_weather.", (SF_WEATHER,)),
    ),
    Documented(
        "gpt-oss", "one-call", _HARMONY_CALL.removeprefix("<|start|>assistant"), ParsedTurn("", "", (SF_WEATHER,))
    ),
    Documented(
        "gpt-oss",
        "content-call",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        f"Let me check the weather.<|end|>{_HARMONY_CALL}",
        ParsedTurn("Let me check the weather.", "Need the weather.", (SF_WEATHER,)),
    ),
    Documented(
        "gpt-oss",
        "parallel",
        f"<|channel|>analysis<|message|>Two cities.<|end|>{_HARMONY_CALL}"
        + _HARMONY_CALL.replace("San Francisco", "Tokyo"),
        ParsedTurn("", "Two cities.", (SF_WEATHER, Call("get_current_weather", {"location": "Tokyo"}))),
    ),
    Documented(  # the recipient in the role header, and the stop token <|call|> stripped
        "gpt-oss",
        "recipient-in-role",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_current_weather"
        '<|channel|>commentary json<|message|>{"location":"San Francisco"}',
        ParsedTurn("", "Need the weather.", (SF_WEATHER,)),
    ),
    Documented(  # the stop token <|call|> stripped
        "gpt-oss", "no-call-token", _HARMONY_CALL.removesuffix("<|call|>"), ParsedTurn("", "", (SF_WEATHER,))
    ),
]

# DeepSeek-V3.1's model card (huggingface.co/deepseek-ai/DeepSeek-V3.1, "Chat Template": thinking opens with
# the prompt's <think>; "ToolCall": the call format).
_DS_CALL = '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Beijing"}<｜tool▁call▁end｜>'
_DS_CALL_2 = '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Shanghai", "days": 3}<｜tool▁call▁end｜>'
DEEPSEEK_V31 = [
    Documented("deepseekv31", "plain", "Beijing is sunny today.", ParsedTurn("Beijing is sunny today.")),
    Documented(
        "deepseekv31",
        "opened-reasoning",
        "The user greets me.</think>Hello!",
        ParsedTurn("Hello!", "The user greets me."),
        in_reasoning=True,
    ),
    Documented(
        "deepseekv31",
        "one-call",
        f"<｜tool▁calls▁begin｜>{_DS_CALL}<｜tool▁calls▁end｜>",
        ParsedTurn("", "", (BEIJING,)),
    ),
    Documented(
        "deepseekv31",
        "parallel",
        f"<｜tool▁calls▁begin｜>{_DS_CALL}{_DS_CALL_2}<｜tool▁calls▁end｜>",
        ParsedTurn("", "", (BEIJING, SHANGHAI_3)),
    ),
    Documented(
        "deepseekv31",
        "content-call",
        f"Let me check.<｜tool▁calls▁begin｜>{_DS_CALL}<｜tool▁calls▁end｜>",
        ParsedTurn("Let me check.", "", (BEIJING,)),
    ),
]

# Meta's Llama 3.1 prompt format (llama.com docs, model-cards-and-prompt-formats/llama3_1: "JSON based tool
# calling"); <|python_tag|> as Llama 3.2 may prefix it.
_LLAMA_CALL = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
)
CONDITIONS = Call("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})
LLAMA3 = [
    Documented(
        "llama3", "plain", "It is 72 degrees in San Francisco.", ParsedTurn("It is 72 degrees in San Francisco.")
    ),
    Documented("llama3", "one-call", _LLAMA_CALL, ParsedTurn("", "", (CONDITIONS,))),
    Documented("llama3", "python-tag", f"<|python_tag|>{_LLAMA_CALL}", ParsedTurn("", "", (CONDITIONS,))),
    Documented(
        "llama3",
        "parallel",
        f"<|python_tag|>{_LLAMA_CALL}; " + _LLAMA_CALL.replace("San Francisco, CA", "Boston, MA"),
        ParsedTurn(
            "", "", (CONDITIONS, Call("get_current_conditions", {"location": "Boston, MA", "unit": "Fahrenheit"}))
        ),
    ),
    Documented(
        "llama3",
        "content-call",
        f"Let me check.<|python_tag|>{_LLAMA_CALL}",
        ParsedTurn("Let me check.", "", (CONDITIONS,)),
    ),
]

# Mistral-7B-Instruct-v0.3's chat template (huggingface.co/mistralai/Mistral-7B-Instruct-v0.3: "[TOOL_CALLS] ["),
# and mistral-common's v11 tokenizer for the compact `[TOOL_CALLS]name[ARGS]{...}`.
PAYMENT = Call("retrieve_payment_status", {"transaction_id": "T1001"})
MISTRAL = [
    Documented("mistral", "plain", "The payment T1001 is paid.", ParsedTurn("The payment T1001 is paid.")),
    Documented(
        "mistral",
        "one-call",
        '[TOOL_CALLS] [{"name": "retrieve_payment_status", "arguments": {"transaction_id": "T1001"}}]',
        ParsedTurn("", "", (PAYMENT,)),
    ),
    Documented(
        "mistral",
        "parallel",
        '[TOOL_CALLS] [{"name": "retrieve_payment_status", "arguments": {"transaction_id": "T1001"}}, '
        '{"name": "get_weather", "arguments": {"city": "Beijing"}}]',
        ParsedTurn("", "", (PAYMENT, BEIJING)),
    ),
    Documented(
        "mistral",
        "compact",
        '[TOOL_CALLS]retrieve_payment_status[ARGS]{"transaction_id": "T1001"}',
        ParsedTurn("", "", (PAYMENT,)),
    ),
    Documented(
        "mistral",
        "compact-parallel",
        '[TOOL_CALLS]retrieve_payment_status[ARGS]{"transaction_id": "T1001"}'
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Beijing"}',
        ParsedTurn("", "", (PAYMENT, BEIJING)),
    ),
    Documented(
        "mistral",
        "content-call",
        'Let me check.[TOOL_CALLS]retrieve_payment_status[ARGS]{"transaction_id": "T1001"}',
        ParsedTurn("Let me check.", "", (PAYMENT,)),
    ),
]

DOCUMENTED = [*QWEN25, *QWEN3_CODER, *GLM45, *GLM47, *KIMI_K2, *GPT_OSS, *DEEPSEEK_V31, *LLAMA3, *MISTRAL]
