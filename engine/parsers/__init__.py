"""One output parser per model family, named as SGLang's `--tool-call-parser` names them, and the family the
running code uses:

    parser = get_parser("kimi_k2")
    turn = parser.parse(text, tools=schemas)       # ParsedTurn(content, reasoning, tool_calls)
    with use_parser("glm45", in_reasoning=True):   # the engine sets this around each env step
        current_parser().name                      # "glm45"; "qwen25" outside any use_parser
        reasoning_open()                           # True: the turn started inside <think> (the prompt opened it)

docs/envs/tool_calls.md shows each family's format.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

from engine.parsers.base import Malformed, MalformedCall, OutputParser, ParsedTurn, ToolCallText
from engine.parsers.glm import Glm45Parser, Glm47Parser
from engine.parsers.harmony import HarmonyParser
from engine.parsers.hermes import HermesParser
from engine.parsers.llama import Llama3Parser
from engine.parsers.mistral import MistralParser
from engine.parsers.qwen3_coder import Qwen3CoderParser
from engine.parsers.sectioned import DeepSeekV31Parser, KimiK2Parser

__all__ = [
    "PARSERS",
    "Malformed",
    "MalformedCall",
    "OutputParser",
    "ParsedTurn",
    "ToolCallText",
    "current_parser",
    "get_parser",
    "reasoning_open",
    "use_parser",
]

DEFAULT_PARSER = "qwen25"
PARSERS: MappingProxyType[str, OutputParser] = MappingProxyType(
    {
        parser.name: parser
        for parser in (
            HermesParser(),
            Qwen3CoderParser(),
            Glm45Parser(),
            Glm47Parser(),
            KimiK2Parser(),
            HarmonyParser(),
            DeepSeekV31Parser(),
            Llama3Parser(),
            MistralParser(),
        )
    }
)
_CURRENT: ContextVar[OutputParser] = ContextVar("turnstile_output_parser", default=PARSERS[DEFAULT_PARSER])
_IN_REASONING: ContextVar[bool] = ContextVar("turnstile_in_reasoning", default=False)


def get_parser(name: str) -> OutputParser:
    """The parser SGLang calls `name`; ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"no output parser {name!r}; the parsers are {', '.join(sorted(PARSERS))}") from None


def current_parser() -> OutputParser:
    """The parser `use_parser` set in this context, else qwen25's."""
    return _CURRENT.get()


def reasoning_open() -> bool:
    """Whether the turns `use_parser` set this context for start inside the reasoning: the generation prompt
    opened `<think>` (Qwen3-Thinking, GLM-4.7, DeepSeek-R1), so the text the model wrote starts with it."""
    return _IN_REASONING.get()


@contextmanager
def use_parser(parser: str | OutputParser, *, in_reasoning: bool = False) -> Iterator[OutputParser]:
    """Make `parser` (or the parser of that name) the current one inside the block, for turns that start
    inside the reasoning when `in_reasoning`."""
    chosen = get_parser(parser) if isinstance(parser, str) else parser
    token, opened = _CURRENT.set(chosen), _IN_REASONING.set(in_reasoning)
    try:
        yield chosen
    finally:
        _CURRENT.reset(token)
        _IN_REASONING.reset(opened)
