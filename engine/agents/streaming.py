"""A turn's text as the model writes it, for a streamed reply: tokens in (as the backend produces them), the
reasoning and the content that can be sent already out, each only ever grown, never taken back.

    split = StreamSplitter(encoder, stop=("STOP",))
    split.feed(token_ids)          # -> [("reasoning", "Let me"), ("content", "It is")] : what is new
    split.sent                     # what has gone out: the final reply sends only what it adds to this

What cannot be known yet is held back: a tool call (from its opening marker on: the calls go out whole, once the
turn is parsed), the end of the text where it may be the start of a marker (`<think>`, `</think>`, a call's
opener) or of a stop string, and a character whose bytes have not all arrived. The markers are the family's, or
those read off the template (a probed layout's; a template whose calls no parser reads streams its reasoning and
content by its own reasoning markers). Turns that are not `[reasoning] content [calls]` (harmony's channels, say)
stream nothing before the turn ends; the reply still starts at once, and keeps its connection alive until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.parsers.probed import NoCallsParser, ProbedParser
from engine.parsers.reasoning import THINK_CLOSE, THINK_OPEN, ThinkingParser, split_reasoning


class TurnText:
    """Token ids decoded as they come, as `ChatEncoder.assistant_text` decodes the whole turn: special tokens
    kept, the turn's stop token dropped, a character whose bytes span tokens given once it is whole."""

    def __init__(self, tokenizer: Any, stop_ids: tuple[int, ...]):
        self._tokenizer, self._stop_ids = tokenizer, frozenset(stop_ids)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # ids[prefix:read] were decoded already; ids[read:] are not yet given
        self.text = ""

    def feed(self, ids: list[int]) -> str:
        """The text `ids` add (possibly none yet)."""
        self._ids += [i for i in ids if i not in self._stop_ids]
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=False)
        after = decode(self._ids[self._prefix :], skip_special_tokens=False)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new


@dataclass
class Sent:
    """What a streamed reply has sent of the turn so far."""

    reasoning: str = ""
    content: str = ""
    diverged: bool = field(default=False)  # a later reading of the text did not extend what was sent

    def rest(self, message: dict[str, Any]) -> list[tuple[str, str]]:
        """The pieces of the turn's final message (its reasoning_content, its content) not sent yet."""
        pieces = []
        for kind, field_name in (("reasoning", "reasoning_content"), ("content", "content")):
            text, had = message.get(field_name) or "", getattr(self, kind)
            if text.startswith(had) and len(text) > len(had):
                pieces.append((kind, text[len(had) :]))
        return pieces


def stream_layout(parser: Any) -> tuple[str, str, str] | None:
    """What a turn read by `parser` streams by: its reasoning block's opening and closing markers and its calls'
    opener ("" where there is none). None for a turn that is not `[reasoning] content [calls]` (harmony's
    channels), which streams nothing before it ends."""
    if isinstance(parser, ThinkingParser):
        return THINK_OPEN, THINK_CLOSE, parser.call_opener
    if isinstance(parser, NoCallsParser):
        return parser.reasoning_open.strip(), parser.reasoning_close.strip(), ""
    if isinstance(parser, ProbedParser):
        layout = parser.layout
        opener = (layout.section_open or layout.call_open).strip()
        return layout.reasoning_open.strip(), layout.reasoning_close.strip(), opener
    return None


class StreamSplitter:
    """The sendable reasoning and content of a turn, as its tokens arrive (the module's docstring)."""

    def __init__(self, encoder: Any, *, stop: tuple[str, ...] = ()):
        layout = stream_layout(encoder.reader)
        self._streams = layout is not None
        self._think_open, self._think_close, self._opener = layout or ("", "", "")
        self._in_reasoning = encoder.opens_reasoning
        self._markers = tuple(m for m in (self._think_open, self._think_close, self._opener, *stop) if m)
        self._cuts = tuple(m for m in (self._opener, *stop) if m)  # nothing after these is sent before the end
        self._text = TurnText(encoder.tokenizer, encoder.stop_token_ids)
        self.sent = Sent()

    def feed(self, ids: list[int]) -> list[tuple[str, str]]:
        """The new pieces, ("reasoning" | "content", text), that `ids` make sendable."""
        if not self._text.feed(ids) or not self._streams or self.sent.diverged:
            return []
        reasoning, rest = split_reasoning(
            self._sendable(self._text.text), in_reasoning=self._in_reasoning, call_opener=self._opener,
            opener=self._think_open, closer=self._think_close,
        )  # fmt: skip
        pieces = []
        for kind, now in (("reasoning", reasoning), ("content", rest.strip())):
            had = getattr(self.sent, kind)
            if not now.startswith(had):
                self.sent.diverged = True  # never taken back: the rest goes out with the final reply
                return pieces
            if len(now) > len(had):
                pieces.append((kind, now[len(had) :]))
                setattr(self.sent, kind, now)
        return pieces

    def _sendable(self, text: str) -> str:
        """`text` up to the first call opener or stop string, less a tail that may begin a marker."""
        cut = min((at for marker in self._cuts if (at := text.find(marker)) >= 0), default=len(text))
        text = text[:cut]
        ends = (
            n
            for marker in self._markers
            for n in range(1, min(len(marker), len(text) + 1))
            if text.endswith(marker[:n])
        )
        held = max(ends, default=0)
        return text[: len(text) - held]
