"""`<think>...</think>` reasoning, as Qwen3, GLM-4.5/4.7, DeepSeek-V3.1 and Kimi-K2-Thinking write it, and the
base of every parser whose turns may start with it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from engine.parsers.base import ParsedTurn, ToolCallText

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(
    text: str, *, in_reasoning: bool, call_opener: str = "", opener: str = THINK_OPEN, closer: str = THINK_CLOSE
) -> tuple[str, str]:
    """(reasoning, the rest). Reasoning is open when the prompt opened it (`in_reasoning`) or the text starts
    with <think> (`opener`); it ends at </think> (`closer`), or at a call's opening marker (SGLang's reasoning
    parsers for Qwen3, GLM-4.5 and Kimi-K2 read a call opened before </think> as the end of the reasoning too),
    else at the end. A template that writes no reasoning block (no `closer`) has none."""
    opener, closer = opener.strip(), closer.strip()
    if not closer:
        return "", text
    if opener and text.lstrip().startswith(opener):
        text, in_reasoning = text.lstrip().removeprefix(opener), True
    if not in_reasoning:
        return "", text
    ends = [(at, len(marker)) for marker in (closer, call_opener) if marker and (at := text.find(marker)) >= 0]
    if not ends:
        return text.strip(), ""
    at, length = min(ends)
    kept = length if text.startswith(closer, at) else 0  # a call's opener stays with the calls
    return text[:at].strip(), text[at + kept :]


class ThinkingParser(ABC):
    """A family whose turn is `[<think>reasoning</think>] content [calls]`: subclasses find the calls."""

    __slots__ = ()
    name: str
    delimiters: tuple[str, ...]
    call_opener: str = ""

    def parse(self, text: str, *, tools: list[dict] | None = None, in_reasoning: bool = False) -> ParsedTurn:
        reasoning, rest = split_reasoning(text, in_reasoning=in_reasoning, call_opener=self.call_opener)
        content, calls = self.split_calls(rest, tools or [])
        return ParsedTurn(content.strip(), reasoning, tuple(calls))

    @abstractmethod
    def split_calls(self, text: str, tools: list[dict]) -> tuple[str, list[ToolCallText]]:
        """The text outside the calls, and the calls, of a turn without its reasoning."""

    @abstractmethod
    def format_call(self, name: str, arguments: dict[str, Any], *, index: int = 0) -> str:
        """One call as the family writes it."""
