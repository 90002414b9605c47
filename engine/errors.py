"""Errors as data: every failure of a turn is classified, so retry budgets and counters can act on it.

A `TurnError` is raised by a backend or an env wrapper; what travels on the trajectory is its frozen
`ErrorRecord`. The classes follow DESIGN.md's retry section.
"""

from __future__ import annotations

import traceback as tb
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class Stage(StrEnum):
    BACKEND = "backend"
    ENV = "env"
    ENCODE = "encode"
    REWARD = "reward"
    FILTER = "filter"
    ENGINE = "engine"


class ErrorClass(StrEnum):
    # backend
    CONNECTION = "connection"  # refused, reset, DNS: retryable
    SERVER = "server"  # HTTP 5xx: retryable
    TIMEOUT = "timeout"  # backend request timed out: retryable
    CLIENT = "client"  # HTTP 4xx: the request is wrong, retrying cannot help
    MALFORMED = "malformed"  # a reply that is not in the server's documented shape
    # env
    ENV_TIMEOUT = "env_timeout"
    ENV_EXCEPTION = "env_exception"
    ENV_RETRYABLE = "env_retryable"  # the env said so (raised EnvRetryableError)
    ENV_WORKER_LOST = "env_worker_lost"  # the env worker process holding the env died (engine/envs/ray_workers.py)
    # an agent program (engine/agents/env.py) crashed, hung past its deadline, or exited before its first request:
    # retried (a fresh agent) only before its first request, as afterwards the agent has seen the session's turns
    AGENT = "agent"
    # encoding of an observation (an image that does not decode, a template that fails)
    BAD_OBSERVATION = "bad_observation"
    BAD_PROMPT = "bad_prompt"  # a prompt row the template or the processor cannot encode
    # the model sampled a token only the VLM processor writes (an image or video placeholder): sent back
    # to the server or to the trainer, it would not match the images
    BAD_RESPONSE = "bad_response"
    # scoring a finished trajectory or group: the reward function raised or did not answer in time
    REWARD = "reward"
    # the LLM judge gave no score: its reply did not parse, or its server failed past the judge's own
    # retries (engine/envs/judge)
    JUDGE = "judge"
    FILTER = "filter"  # the group filter raised: the group's members fail
    # anything else that went wrong in handling one trajectory (a bug, or a user hook outside the
    # classes above, e.g. a failing drift check or conversion): that trajectory fails, nothing else
    INTERNAL = "internal"


RETRYABLE = frozenset(
    {
        ErrorClass.CONNECTION,
        ErrorClass.SERVER,
        ErrorClass.TIMEOUT,
        ErrorClass.ENV_TIMEOUT,
        ErrorClass.ENV_RETRYABLE,
        ErrorClass.ENV_WORKER_LOST,
        ErrorClass.REWARD,
    }
)


def stage_of(error_class: ErrorClass) -> Stage:
    """The stage an error class belongs to (the `stage` label of the retry metrics)."""
    return _STAGE_OF_CLASS.get(error_class) or (Stage.ENV if error_class.value.startswith("env_") else Stage.BACKEND)


_STAGE_OF_CLASS = {
    ErrorClass.BAD_OBSERVATION: Stage.ENCODE,
    ErrorClass.BAD_PROMPT: Stage.ENCODE,
    ErrorClass.BAD_RESPONSE: Stage.ENCODE,
    ErrorClass.AGENT: Stage.ENV,
    ErrorClass.REWARD: Stage.REWARD,
    ErrorClass.JUDGE: Stage.REWARD,
    ErrorClass.FILTER: Stage.FILTER,
    ErrorClass.INTERNAL: Stage.ENGINE,
}


@dataclass(frozen=True, slots=True)
class ErrorRecord:
    """One failure, as it is stored on a trajectory and counted. `turn`: the index of the turn it happened
    in (or after, for a reward), None before the first turn; `traceback`: where in the user's code (an env,
    a reward function, a hook) the exception behind it was raised, None when it came from no such code."""

    error_class: ErrorClass
    stage: Stage
    message: str
    turn: int | None
    traceback: str | None = None

    @property
    def retryable(self) -> bool:
        return self.error_class in RETRYABLE


class TurnError(Exception):
    """A classified failure of one turn. `message` names the thing at fault."""

    stage: Stage = Stage.BACKEND

    def __init__(self, error_class: ErrorClass, message: str, *, traceback: str | None = None):
        super().__init__(message)
        self.error_class = error_class
        self.message = message
        self.traceback = traceback  # given where the cause cannot travel with it (from an env worker's process)

    @property
    def retryable(self) -> bool:
        return self.error_class in RETRYABLE

    def record(self, turn: int | None) -> ErrorRecord:
        return ErrorRecord(self.error_class, self.stage, self.message, turn, self.traceback or user_traceback(self))

    def noted(self, note: str) -> TurnError:
        """The same error, of the same class, with `note` appended to its message."""
        error = Exception.__new__(type(self))
        error.__dict__.update(self.__dict__)
        error.message = f"{self.message} ({note})"
        error.args = (error.message,)
        error.__cause__ = self.__cause__
        return error


class BackendError(TurnError):
    stage = Stage.BACKEND


class EnvError(TurnError):
    stage = Stage.ENV


class ObservationError(TurnError):
    stage = Stage.ENCODE

    def __init__(self, message: str):
        super().__init__(ErrorClass.BAD_OBSERVATION, message)


class PromptError(TurnError):
    stage = Stage.ENCODE

    def __init__(self, message: str):
        super().__init__(ErrorClass.BAD_PROMPT, message)


class ResponseError(TurnError):
    stage = Stage.ENCODE

    def __init__(self, message: str):
        super().__init__(ErrorClass.BAD_RESPONSE, message)


class RewardError(TurnError):
    stage = Stage.REWARD

    def __init__(self, message: str):
        super().__init__(ErrorClass.REWARD, message)


class FilterError(TurnError):
    stage = Stage.FILTER

    def __init__(self, message: str):
        super().__init__(ErrorClass.FILTER, message)


class InternalError(TurnError):
    """An exception outside the classes above, raised while handling one trajectory: kept as data on that
    trajectory (its type and message), which fails; the engine and the other trajectories go on."""

    stage = Stage.ENGINE

    def __init__(self, message: str):
        super().__init__(ErrorClass.INTERNAL, message)

    @classmethod
    def of(cls, exc: BaseException, doing: str) -> InternalError:
        error = cls(f"{doing} raised {exc!r}")
        error.__cause__ = exc
        return error


# Frames left out of a user traceback: the engine's own, the standard library's, and those of the
# libraries that ran the call (a user's code installed beside them, in site-packages, is kept).
_OWN = tuple(str(path.resolve()) + "/" for path in (Path(__file__).parent, Path(__file__).parent.parent / "bridge"))
_STDLIB = str(Path(tb.__file__).parent.resolve()) + "/"
_RUNNERS = ("anyio", "sniffio", "ray")
_MAX_FRAMES = 16


def user_traceback(error: BaseException) -> str | None:
    """The traceback of the first exception behind `error` that is not a TurnError, trimmed to the frames
    of the code that raised it (an env's, a hook's): the engine's, the standard library's, anyio's and
    Ray's are left out, and at most the innermost 16 kept. None when there is no such exception or frame."""
    cause = error.__cause__
    while isinstance(cause, TurnError):
        if cause.traceback is not None:
            return cause.traceback
        cause = cause.__cause__
    if cause is None or cause.__traceback__ is None:
        return None
    frames = [f for f in tb.extract_tb(cause.__traceback__) if not _is_own(f.filename)][-_MAX_FRAMES:]
    if not frames:
        return None
    lines = tb.format_list(frames) + tb.format_exception_only(type(cause), cause)
    return "Traceback (most recent call last):\n" + "".join(lines).rstrip("\n")


def _is_own(filename: str) -> bool:
    path = str(Path(filename).resolve())
    if path.startswith(_OWN):
        return True
    for packages in ("/site-packages/", "/dist-packages/"):
        if packages in path:
            return path.split(packages, 1)[1].split("/", 1)[0] in _RUNNERS
    return path.startswith(_STDLIB)


class EnvRetryableError(Exception):
    """Raise from an env's `step` to say: this failure is transient, the same step may be tried again."""
