"""The answer to one request, filled by the task that waits for the model's turn and read by the response that
sends it: the pieces of text streamed so far, then the reply (or the error). The waiting task is not the
response's, so a client that leaves mid-way leaves the turn whole for its retry.

    answer = Answer()
    answer.put([("content", "It is")])      # as the tokens come (a streamed reply sends each piece)
    answer.finish(message, info)            # or answer.fail(error); `done` is set either way
"""

from __future__ import annotations

from typing import Any

import anyio

from engine.agents.request import RequestError, TurnInfo
from engine.agents.streaming import Sent, StreamSplitter


class Answer:
    """`original`: the answer this one repeats (a client's retry), delivered with it. Whoever sends the reply
    says when it has reached its client (`deliver`): a reply never delivered is given again to the same request
    asked again, which is then a retry whether it says so or not."""

    def __init__(self, *, original: Answer | None = None) -> None:
        self.original = original
        self.pieces: list[tuple[str, str]] = []  # ("reasoning" | "content", text), in order
        self.message: dict[str, Any] | None = None
        self.info: TurnInfo | None = None
        self.error: RequestError | None = None
        self.prompt_tokens = 0  # the tokens before the turn, as far as known when it started
        self.split: StreamSplitter | None = None  # what makes the pieces, for a streamed reply
        self.delivered = False  # the reply reached its client whole
        self.done = anyio.Event()
        self._changed = anyio.Event()

    @property
    def sent(self) -> Sent:
        """What the pieces have sent of the turn."""
        return self.split.sent if self.split is not None else Sent()

    @property
    def diverged(self) -> bool:
        return self.split is not None and self.split.sent.diverged

    def put(self, pieces: list[tuple[str, str]]) -> None:
        if pieces:
            self.pieces += pieces
            self._wake()

    def finish(self, message: dict[str, Any], info: TurnInfo) -> None:
        self.message, self.info = message, info
        self.done.set()
        self._wake()

    def fail(self, error: RequestError) -> None:
        self.error = error
        self.done.set()
        self._wake()

    def deliver(self) -> None:
        """The reply reached its client whole (and so did the one it repeats)."""
        self.delivered = True
        if self.original is not None:
            self.original.delivered = True

    async def changed(self) -> None:
        """Until a piece arrives or the answer is done."""
        await self._changed.wait()

    async def started(self) -> None:
        """Until the first piece, or the end."""
        while not (self.pieces or self.done.is_set()):
            await self.changed()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
