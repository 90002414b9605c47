"""A turn read elsewhere, as an output parser: SGLang's own parsers read the turn on its server
(engine/backends/sglang_read.py), and the env's `parse_tool_calls` gets that reading through the usual
`current_parser()`, so env code is the same whoever reads the turn.

    with use_parser(ReadTurn("minimax-m2", text, turn, fallback=None)):
        await runner.step(text)            # parse_tool_calls(text, tools) gives `turn`'s calls
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.parsers.base import OutputParser, ParsedTurn


@dataclass(frozen=True, slots=True)
class ReadTurn:
    """The reading `turn` of the model's turn `text`, by the parser SGLang calls `name`. Other text (an env
    parsing something it made itself) goes to `fallback`, the engine's own parser of the model, where it has one;
    without one it is a ValueError. `format_call` writes a call as `fallback` does, or not at all ("")."""

    name: str
    text: str
    turn: ParsedTurn
    fallback: OutputParser | None = None

    @property
    def delimiters(self) -> tuple[str, ...]:
        return ()  # the server read the turn from its tokens, special tokens kept

    def parse(self, text: str, *, tools: list[dict] | None = None, in_reasoning: bool = False) -> ParsedTurn:
        if text == self.text:
            return self.turn
        if self.fallback is None:
            raise ValueError(
                f"SGLang's {self.name} parser read this turn's text only; other text has no parser in the engine"
            )
        return self.fallback.parse(text, tools=tools, in_reasoning=in_reasoning)

    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        return "" if self.fallback is None else self.fallback.format_call(name, arguments, index=index)
