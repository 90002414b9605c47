"""Scripted test doubles for the model and the env. They record what they were asked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.backends.base import GenerateResult, SamplingParams
from engine.envs.base import BaseInteractionEnv
from engine.errors import BackendError, ErrorClass


@dataclass
class Request:
    input_ids: list[int]
    sampling_params: SamplingParams
    image_data: list[str] | None
    rid: str | None


class ScriptedBackend:
    """Answers each generate call with the next scripted token list (or raises the next scripted error).

    A reply is truncated to the request's max_new_tokens, as a real server would; finish_reason is
    "stop" when the reply ends with one of the request's stop tokens, else "length".
    """

    def __init__(
        self, replies: Sequence[Sequence[int] | Exception], *, logprob: float = -0.5, weight_version: str = "v0"
    ):
        self.replies = list(replies)
        self.logprob = logprob
        self.weight_version_ = weight_version
        self.requests: list[Request] = []

    async def generate(self, input_ids, sampling_params, image_data=None, *, rid=None) -> GenerateResult:
        self.requests.append(
            Request(list(input_ids), sampling_params, None if image_data is None else list(image_data), rid)
        )
        if not self.replies:
            raise BackendError(ErrorClass.MALFORMED, "scripted backend: no reply left")
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        ids = list(reply)[: sampling_params.max_new_tokens]
        stopped = bool(ids) and ids[-1] in sampling_params.stop_token_ids
        return GenerateResult(
            token_ids=ids,
            logprobs=[self.logprob] * len(ids),
            text="",
            finish_reason="stop" if stopped else "length",
            weight_version=self.weight_version_,
            prompt_tokens=len(input_ids),
        )

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
