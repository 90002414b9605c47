"""Where prompts come from: rows `{"prompt": [chat messages] or "rendered text", "label": ..., "metadata": {...}}`.

A source hands out rows as the engine asks for them (`take`), so over-sampling pulls only what it
needs. Any iterable of rows works through `RowSource`; `jsonl_rows` reads a JSONL file with one
clear error per bad line. slime's data source is adapted in the bridge.
"""

from __future__ import annotations

import difflib
import itertools
import json
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PromptSource(Protocol):
    def take(self, n: int) -> list[dict[str, Any]]:
        """Up to `n` rows; fewer, or none, once the source runs dry."""
        ...


class RowSource:
    """A PromptSource over any iterable of rows (a list, a generator, `jsonl_rows(...)`)."""

    def __init__(self, rows: Iterable[dict[str, Any]]):
        self._rows = iter(rows)

    def take(self, n: int) -> list[dict[str, Any]]:
        """Up to `n` rows as they are: the engine checks each (a bad one fails its own group)."""
        return list(itertools.islice(self._rows, n))


class QueueSource:
    """A PromptSource that is fed: rows are `put` as they arrive (from slime's data source, step by
    step) and handed out in order; rows not taken yet stay for later."""

    def __init__(self) -> None:
        self._rows: deque[dict[str, Any]] = deque()

    def put(self, rows: Iterable[dict[str, Any]]) -> None:
        self._rows.extend(check_row(row, where="a queued prompt row") for row in rows)

    def take(self, n: int) -> list[dict[str, Any]]:
        return [self._rows.popleft() for _ in range(min(n, len(self._rows)))]

    def __len__(self) -> int:
        return len(self._rows)

    def pending(self) -> list[dict[str, Any]]:
        """The rows not taken yet, in order."""
        return list(self._rows)


# The roles a chat template renders; `developer` (OpenAI's name for the system message) is rendered as `system`
# (engine/encoding.py). A template renders another role as nothing, or raises on it.
ROLES = ("system", "developer", "user", "assistant", "tool")

# Where other datasets keep a row's prompt (OpenAI-style `messages`, HF chat sets' `conversations`, ...).
PROMPT_KEYS_ELSEWHERE = ("messages", "conversations", "conversation", "input", "question", "text")


def json_lines(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of a JSONL file, parsed, with where it is (`file:line`); a line that is not JSON
    raises ValueError naming it."""
    with Path(path).open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object: {exc}") from exc


def jsonl_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL file, checked as they are read; a bad line raises ValueError naming file:line."""
    for where, row in json_lines(path):
        yield check_messages(check_row(row, where=where), where=where)


def check_row(row: Any, *, where: str) -> dict[str, Any]:
    """A row's prompt is chat messages, or text already rendered with the chat template (given to the
    model as it is, as slime's `--apply-chat-template` prompts are); its `metadata`, when given, a
    mapping, its `images` (beside a rendered prompt) a list, and the role of each of its messages one a chat
    template renders (ROLES)."""
    if isinstance(row, dict) and "prompt" not in row and (others := sorted(set(row) & set(PROMPT_KEYS_ELSEWHERE))):
        raise ValueError(
            f"{where}: no 'prompt', but {others[0]!r}: a row gives its chat messages (or rendered text) as "
            f'\'prompt\', e.g. {{"prompt": [{{"role": "user", "content": "..."}}]}}'
        )
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), list | str):
        raise ValueError(f"{where}: 'prompt' must be a list of chat messages or rendered text")
    if not isinstance(row.get("metadata") or {}, Mapping):
        raise ValueError(f"{where}: 'metadata' must be an object, not {type(row['metadata']).__name__}")
    if not isinstance(row.get("images") or [], list | tuple):
        raise ValueError(f"{where}: 'images' must be a list of images, not {type(row['images']).__name__}")
    for i, message in enumerate(row["prompt"] if isinstance(row["prompt"], list) else ()):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in ROLES:
            close = difflib.get_close_matches(role, ROLES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{where}: prompt message {i} has role {role!r}{hint}: one of {', '.join(ROLES)} "
                "(a chat template renders another role as nothing, or raises)"
            )
    return row


def check_messages(row: dict[str, Any], *, where: str) -> dict[str, Any]:
    """A file's row, checked further before the run: a prompt that is not empty, and chat messages that
    are objects with a string `role` and text or a list of parts as `content` (a template renders a
    message without a role as nothing)."""
    prompt = row["prompt"]
    if not prompt:
        raise ValueError(f"{where}: 'prompt' is empty")
    for i, message in enumerate(prompt if isinstance(prompt, list) else ()):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: prompt message {i} must be an object with a string 'role', got {message!r:.80}")
        if not isinstance(message.get("content"), str | list | None):
            kind = type(message["content"]).__name__
            raise ValueError(f"{where}: prompt message {i}: 'content' must be text or a list of parts, not {kind}")
    return row
