"""The judge's prompt and the reading of its reply: a rubric file, a conversation rendered into it, a score.

A rubric is a text file with two placeholders: `{{conversation}}` (the transcript of the conversation
being judged) and `{{max_score}}` (the top of the scale). A rubric without `{{conversation}}` gets the
transcript appended. The judge is asked in one user message, so any chat template renders it.

    rubric = Rubric.load(None)                       # the packaged rubric.md; or a path
    messages = rubric.messages([{"role": "user", "content": "Explain DNS."}, {"role": "assistant", ...}])
    parse_score("Clear and correct. Score: 8/10", max_score=10)      # 8.0

A reply is read for a JSON object with a numeric "score", else the last `Score: N` (or `Score: N/M`,
scaled to `max_score`); anything else, or a score off the scale, raises UnparseableScore.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.envs.judge.errors import UnparseableScore

CONVERSATION = "{{conversation}}"
MAX_SCORE = "{{max_score}}"
_SCORE_LINE = re.compile(r"score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)(?:\s*(?:/|out of)\s*(\d+(?:\.\d+)?))?", re.I)
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
_SCORE_LINE_TO_DROP = re.compile(r"^\W*score\b.*$", re.I | re.M)


@dataclass(frozen=True, slots=True)
class Rubric:
    text: str
    max_score: float = 10.0
    source: str = "rubric.md"

    @classmethod
    def load(cls, path: str | None, *, max_score: float = 10.0) -> Rubric:
        """The rubric in `path`, or the packaged default. Raises ValueError naming the file when it is
        missing, unreadable or empty."""
        if path is None:
            text = (importlib.resources.files("engine.envs.judge") / "rubric.md").read_text()
            return cls(text, max_score, "the packaged rubric.md")
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"judge rubric {path!r} does not read: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ValueError(f"judge rubric {path!r} is not UTF-8 text: {exc}") from exc
        if not text.strip():
            raise ValueError(f"judge rubric {path!r} is empty")
        return cls(text, max_score, path)

    def render(self, conversation: list[dict[str, Any]]) -> str:
        """The judge prompt: the rubric with the conversation's transcript and the scale filled in."""
        text = self.text.replace(MAX_SCORE, f"{self.max_score:g}")
        transcript = transcript_of(conversation)
        if CONVERSATION not in text:
            return f"{text.rstrip()}\n\n{transcript}\n"
        return text.replace(CONVERSATION, transcript)

    def messages(self, conversation: list[dict[str, Any]]) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.render(conversation)}]


def transcript_of(conversation: list[dict[str, Any]]) -> str:
    """Each message as `[role]` and its text; an image part is written `[image]`."""
    return "\n\n".join(
        f"[{message.get('role', 'user')}]\n{text_of(message.get('content'))}" for message in conversation
    )


def text_of(content: Any) -> str:
    """A message's content as text: text parts joined, images as `[image]`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, dict) and part.get("type") in ("image", "image_url"):
            parts.append("[image]")
        else:
            parts.append(str(part))
    return "\n".join(parts)


def parse_score(reply: str, max_score: float) -> float:
    """The score in a judge's reply, on the scale 0..max_score. Raises UnparseableScore."""
    score = _json_score(reply)
    if score is None:
        matches = _SCORE_LINE.findall(reply)
        if not matches:
            raise UnparseableScore(f"the judge's reply has no score (no 'Score: N' line, no JSON score): {_cut(reply)}")
        value, scale = matches[-1]
        score = float(value) * (max_score / float(scale) if scale and float(scale) > 0 else 1.0)
    if not 0 <= score <= max_score:
        raise UnparseableScore(f"the judge's score {score:g} is off the scale 0..{max_score:g}: {_cut(reply)}")
    return score


def critique_of(reply: str) -> str:
    """The judge's reply without its score line: the critique, shown to the model for a revision."""
    return _SCORE_LINE_TO_DROP.sub("", reply).strip()


def _json_score(reply: str) -> float | None:
    for candidate in reversed(_JSON_OBJECT.findall(reply)):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        score = value.get("score") if isinstance(value, dict) else None
        if isinstance(score, int | float) and not isinstance(score, bool):
            return float(score)
    return None


def _cut(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
