"""What the gateway's dialects share: reading a request's parsed body into a model, the one error a bad request
gets (each dialect writes it in its API's own error format), and what a reply reports of its turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class RequestError(ValueError):
    """A request the gateway cannot serve: HTTP `status`, the offending `param`, OpenAI's error `type` and
    `code` (`context_length_exceeded`, `invalid_api_key`, ...: what clients match on)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def validated(raw: Any, model: type[Model]) -> Model:
    """The parsed body as `model`, or RequestError naming the first thing wrong (where, and what)."""
    if not isinstance(raw, dict):
        raise RequestError("the body is not a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        text = error["msg"].removeprefix("Value error, ")
        raise RequestError(text if text.startswith(where) else f"{where}: {text}", param=where or None) from None


def forces_a_call(tool_choice: Any) -> bool:
    """Whether a `tool_choice` asks the policy for a call it would not choose itself (OpenAI's "required" or a
    named tool, Anthropic's `any` or `tool`): the rollout's policy chooses its own calls."""
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
    return kind not in (None, "auto", "none")


def check_policy_rules(tool_choice: Any, asked: list[str], client_sampling: Literal["ignore", "refuse"]) -> None:
    """With `client_sampling="refuse"`, what a request may not ask of the policy: a forced tool choice, or
    sampling of its own (`asked`: the fields it set). Otherwise both are ignored (and counted by the gateway)."""
    if client_sampling != "refuse":
        return
    if forces_a_call(tool_choice):
        raise RequestError(
            f"tool_choice={tool_choice!r}: the policy chooses its own calls (leave it out, or 'auto')",
            param="tool_choice",
        )
    if asked := [name for name in asked if name != "tool_choice"]:
        raise RequestError(f"{', '.join(asked)}: the rollout's sampling settings rule", param=asked[0])


@dataclass(frozen=True, slots=True)
class TurnInfo:
    """What every API reports of a turn beside its message: usage, and why it ended where it did not end on its
    own (`length`: at the client's own token cap; `stop_sequence`: at one of the client's stop strings)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the server found in its prefix cache
    length: bool = False
    stop_sequence: str | None = None

    @property
    def tokens(self) -> tuple[int, int, int]:
        """(prompt, completion, cached): the usage every API reports."""
        return self.prompt_tokens, self.completion_tokens, self.cached_tokens


def sse(data: str, event: str | None = None) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n" if event is None else f"event: {event}\ndata: {data}\n\n"
