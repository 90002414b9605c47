"""What the gateway's dialects share about a request: reading its body into a model, and the one error a bad
request gets (each dialect writes it in its API's own error format)."""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class RequestError(ValueError):
    """A request the gateway cannot serve: HTTP `status`, the offending `param`, OpenAI's error `type`."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


def validated(body: bytes, model: type[Model]) -> Model:
    """The body as `model`, or RequestError naming the first thing wrong (where, and what)."""
    try:
        raw = json.loads(body)
    except ValueError as exc:
        raise RequestError(f"the body is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise RequestError("the body is not a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        text = error["msg"].removeprefix("Value error, ")
        raise RequestError(text if text.startswith(where) else f"{where}: {text}", param=where or None) from None


def check_policy_rules(tool_choice: Any, asked: list[str], client_sampling: Literal["ignore", "refuse"]) -> None:
    """What a request may not ask of the policy: a forced tool choice (the policy chooses its own calls), or,
    with `client_sampling="refuse"`, sampling of its own (`asked`: the fields it set)."""
    if tool_choice not in (None, "auto"):
        raise RequestError(
            f"tool_choice={tool_choice!r}: the policy chooses its own calls (leave it out, or 'auto')",
            param="tool_choice",
        )
    if client_sampling == "refuse" and asked:
        raise RequestError(f"{', '.join(asked)}: the rollout's sampling settings rule", param=asked[0])
