"""Scripted test doubles for the model and the env. They record what they were asked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.backends.base import GenerateResult, SamplingParams, TokenListener, notify
from engine.envs.base import BaseInteractionEnv
from engine.errors import BackendError, ErrorClass


@dataclass
class Request:
    input_ids: list[int]
    sampling_params: SamplingParams
    image_data: list[str] | None
    rid: str | None
    session_id: str | None = None
    is_streamed: bool = False  # given a token listener


async def stream_tokens(token_ids: Sequence[int], on_tokens: TokenListener | None) -> None:
    """Hand `token_ids` to `on_tokens` one at a time, yielding to the event loop between two, as a streaming
    server's chunks arrive."""
    for token in token_ids:
        on_tokens = notify(on_tokens, [token])
        await anyio.lowlevel.checkpoint()


class Listener:
    """A token listener that records each call; `reached(n)` is set once n tokens came."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self._waits: dict[int, anyio.Event] = {}

    def __call__(self, token_ids: list[int]) -> None:
        self.calls.append(list(token_ids))
        for n, event in self._waits.items():
            if len(self.tokens) >= n:
                event.set()

    @property
    def tokens(self) -> list[int]:
        return [t for call in self.calls for t in call]

    def reached(self, n: int) -> anyio.Event:
        return self._waits.setdefault(n, anyio.Event())


class ScriptedBackend:
    """Answers each generate call with the next scripted token list, or GenerateResult (returned as it is), or
    raises the next scripted error. It streams: given a listener, the reply's tokens go to it one at a time.

    A token list is truncated to the request's max_new_tokens, as a real server would; finish_reason is
    "stop" when the reply ends with one of the request's stop tokens, else "length".
    """

    streams = True

    def __init__(
        self,
        replies: Sequence[Sequence[int] | GenerateResult | Exception],
        *,
        logprob: float = -0.5,
        weight_version: str = "v0",
    ):
        self.replies = list(replies)
        self.logprob = logprob
        self.weight_version_ = weight_version
        self.requests: list[Request] = []

    async def generate(
        self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None, on_tokens=None
    ) -> GenerateResult:
        images = None if image_data is None else list(image_data)
        self.requests.append(Request(list(input_ids), sampling_params, images, rid, session_id, on_tokens is not None))
        if not self.replies:
            raise BackendError(ErrorClass.MALFORMED, "scripted backend: no reply left")
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        if not isinstance(reply, GenerateResult):
            ids = list(reply)[: sampling_params.max_new_tokens]
            stopped = bool(ids) and ids[-1] in sampling_params.stop_token_ids
            reply = GenerateResult(
                token_ids=ids,
                logprobs=[self.logprob] * len(ids),
                text="",
                finish_reason="stop" if stopped else "length",
                weight_version=self.weight_version_,
                prompt_tokens=len(input_ids),
            )
        await stream_tokens(reply.token_ids, on_tokens)
        return reply

    async def abort(self, rid=None) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def weight_version(self) -> str | None:
        return self.weight_version_

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None: ...


@dataclass
class ScriptedEnv(BaseInteractionEnv):
    """Answers step i with observations[i], each a chat message (format_observation returns it as is);
    done after the last one (or never, when `done_at_end` is False). An Exception in `observations` is
    raised by that step."""

    observations: list[dict[str, Any] | Exception]
    done_at_end: bool = True
    reward: float = 1.0
    seen: list[str] = field(default_factory=list)
    num_resets: int = 0
    closed: bool = False

    def reset(self):
        self.num_resets += 1
        return {}, {}

    def step(self, response_text: str):
        self.seen.append(response_text)
        i = len(self.seen) - 1
        item = self.observations[min(i, len(self.observations) - 1)]
        if isinstance(item, Exception):
            raise item
        done = self.done_at_end and i >= len(self.observations) - 1
        return item, done, {"reward": self.reward} if done else {}

    def format_observation(self, observation):
        return observation

    def close(self):
        self.closed = True


class DeterministicBackend:
    """A model whose every token is a function of the tokens before it, so a generation aborted and
    resumed later continues exactly as it would have, and any two runs agree.

    Each token yields to the event loop, so requests interleave and can be aborted mid-generation
    (they return what they have, finish reason "abort"); given a listener, each token goes to it as it is
    made (`num_produced` counts the tokens made so far, over all calls). `stop_every` sets the mean turn length:
    the stop token (the request's first stop id) comes when a prefix hash hits 0 mod `stop_every`.
    `failures` maps an attempt number (1-based, over all generate calls) to an error raised instead.
    """

    streams = True

    def __init__(
        self, *, stop_every: int = 6, weight_version: str = "v0", failures: dict[int, Exception] | None = None
    ):
        self.num_produced = 0
        self.stop_every = stop_every
        self.version = weight_version
        self.failures = dict(failures or {})
        self.num_calls = 0
        self.running: dict[str, bool] = {}  # rid -> aborted
        self.max_running = 0
        self.session_ids: list[str | None] = []  # of each generate call

    async def generate(
        self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None, on_tokens=None
    ) -> GenerateResult:
        self.num_calls += 1
        self.session_ids.append(session_id)
        if (error := self.failures.pop(self.num_calls, None)) is not None:
            await anyio.lowlevel.checkpoint()
            raise error
        rid = rid or f"r{self.num_calls}"
        self.running[rid] = False
        self.max_running = max(self.max_running, len(self.running))
        state = 0
        for token in input_ids:  # a rolling hash of the whole prefix: any split point gives the same tokens
            state = hash((state, token))
        stop = sampling_params.stop_token_ids[0] if sampling_params.stop_token_ids else None
        ids: list[int] = []
        finish = "length"
        try:
            while len(ids) < sampling_params.max_new_tokens:
                await anyio.lowlevel.checkpoint()
                if self.running[rid]:
                    finish = "abort"
                    break
                token = stop if stop is not None and state % self.stop_every == 0 else 1000 + state % 5000
                ids.append(token)
                self.num_produced += 1
                on_tokens = notify(on_tokens, [token])
                state = hash((state, token))
                if token == stop:
                    finish = "stop"
                    break
        finally:
            del self.running[rid]
        return GenerateResult(ids, [-0.25] * len(ids), "", finish, self.version, prompt_tokens=len(input_ids))

    async def abort(self, rid=None) -> None:
        for key in self.running:
            if rid is None or key == rid:
                self.running[key] = True

    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def weight_version(self) -> str | None:
        return self.version

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None: ...
