"""Environments: slime's interaction-env contract, an async variant, and the runner the turn loop uses.

A user env is what slime's multi-turn examples load (so those envs load unchanged):

    class MyEnv(BaseInteractionEnv):
        def reset(self): return {}, {}
        def step(self, response_text): return {"obs_str": "try again"}, False, {}

    def build_env(sample=None, args=None, **kw): return MyEnv()

`step` returns `(observation, done, info)`; `format_observation(observation)` turns an observation
into the next chat message, images from `observation["multi_modal_data"]`. An env may instead
subclass `AsyncInteractionEnv` and define `async astep`. A sync `step` runs in a worker thread
under a timeout, so a blocking env (a subprocess, a sandbox call) never stalls the event loop.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from engine.envs.deadlines import Deadlines
from engine.errors import EnvError, EnvRetryableError, ErrorClass, TurnError


class BaseInteractionEnv:
    """slime's interaction-env contract."""

    # Set True when `reset()` followed by replaying the earlier responses rebuilds the same state,
    # so a failed step may be retried on a fresh env.
    replay_safe: bool = False

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        raise NotImplementedError

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        return default_format_observation(observation)


class AsyncInteractionEnv(BaseInteractionEnv):
    """An env whose steps are coroutines (an HTTP tool, a remote sandbox). Define `astep`."""

    async def areset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.reset()

    async def astep(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        raise NotImplementedError

    async def aclose(self) -> None:
        self.close()

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {}


def default_format_observation(observation: dict[str, Any] | None) -> dict[str, Any]:
    """A user message: every image in `multi_modal_data`, then the text in `obs_str`."""
    observation = observation or {}
    content: list[dict[str, Any]] = [
        {"type": "image", "image": image}
        for images in (observation.get("multi_modal_data") or {}).values()
        for image in images
    ]
    content.append({"type": "text", "text": observation.get("obs_str", "")})
    return {"role": "user", "content": content}


@dataclass(frozen=True, slots=True)
class StepResult:
    observation: dict[str, Any]
    done: bool
    info: dict[str, Any]


class EnvRunner:
    """Drives one env object for the turn loop and classifies what goes wrong.

    Every failure surfaces as `EnvError`: ENV_TIMEOUT when `reset` or `step` runs past
    `step_timeout`, ENV_RETRYABLE when the env raised `EnvRetryableError`, ENV_EXCEPTION for anything
    else (a bad return shape, or a TimeoutError the env raised itself, included).
    """

    def __init__(
        self,
        env: Any,
        *,
        format_observation: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        step_timeout: float | None = None,
        limiter: anyio.CapacityLimiter | None = None,
        name: str | None = None,
    ):
        if not callable(getattr(env, "step", None)) and not callable(getattr(env, "astep", None)):
            raise TypeError(f"env {type(env).__name__} has neither step() nor astep()")
        self.env = env
        self.name = name or type(env).__name__
        self.step_timeout = step_timeout
        self.limiter = limiter  # worker threads for sync envs; None: anyio's default (40 threads)
        self.deadlines: Deadlines | None = None  # the engine's shared timeout watcher; None: a timer per call
        self._abandoned: threading.Event | None = None  # set when a sync call that timed out has returned
        self._methods: dict[str, tuple[Callable[..., Any] | None, bool]] = {}
        self._format = format_observation or getattr(env, "format_observation", None) or default_format_observation

    @property
    def replay_safe(self) -> bool:
        return bool(getattr(self.env, "replay_safe", False))

    @property
    def is_busy(self) -> bool:
        """A sync call that timed out is still running in its worker thread, touching the env: the env
        must not be called again (a retry needs a fresh env)."""
        return self._abandoned is not None and not self._abandoned.is_set()

    async def reset(self) -> dict[str, Any]:
        """Reset the env; returns its initial observation (often empty)."""
        result = await self._call("reset")
        observation = result[0] if isinstance(result, tuple) and result else result
        return observation if isinstance(observation, dict) else {}

    async def step(self, response_text: str) -> StepResult:
        result = await self._call("step", response_text)
        if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], dict | None)):
            raise EnvError(
                ErrorClass.ENV_EXCEPTION,
                f"env {self.name}.step returned {_short(result)}, expected (observation: dict, done: bool, info: dict)",
            )
        observation, done, info = result
        return StepResult(observation or {}, bool(done), info if isinstance(info, dict) else {})

    def message(self, observation: dict[str, Any]) -> dict[str, Any]:
        """The chat message for an observation, by the env's (or its module's) format_observation."""
        try:
            message = self._format(observation)
        except Exception as exc:
            raise EnvError(ErrorClass.ENV_EXCEPTION, f"env {self.name}.format_observation raised {exc!r}") from exc
        if not (isinstance(message, dict) and "role" in message and "content" in message):
            raise EnvError(
                ErrorClass.ENV_EXCEPTION,
                f"env {self.name}.format_observation returned {_short(message)}, expected a chat message dict",
            )
        return message

    async def close(self, timeout: float = 10.0) -> None:
        """Close the env, shielded from cancellation and bounded by `timeout`. Raises EnvError."""
        with anyio.move_on_after(timeout, shield=True):
            if self.is_busy:  # let the abandoned call return first: closing under it could break either
                # bounded in the thread too: a thread left waiting would keep the process from exiting
                await anyio.to_thread.run_sync(self._abandoned.wait, timeout, abandon_on_cancel=True)
                if self.is_busy:
                    return  # still running after `timeout`: the env is left to it, unclosed (its timeout was counted)
            await self._call("close")

    async def _call(self, method: str, *args: Any) -> Any:
        """Call the env's `a<method>` coroutine if it has one, else `<method>` in a worker thread.

        `reset` and `step` run under `step_timeout`. A sync call past it is abandoned: its thread
        may still be running and touching the env, so `is_busy` holds until it returns and the env
        is not to be called again (retry on a fresh env)."""
        if self.is_busy:
            raise EnvError(
                ErrorClass.ENV_EXCEPTION, f"env {self.name}.{method}: an earlier call that timed out is still running"
            )
        fn, is_async = self._method(method)
        result = call = None
        timeout = None if method == "close" else self.step_timeout
        with self._timeout(timeout) as scope:
            try:
                if is_async:
                    result = await fn(*args)
                elif fn is not None:
                    call = _ThreadCall(fn)
                    result = await anyio.to_thread.run_sync(call, *args, abandon_on_cancel=True, limiter=self.limiter)
            except EnvRetryableError as exc:
                raise EnvError(ErrorClass.ENV_RETRYABLE, f"env {self.name}.{method} asked for a retry: {exc}") from exc
            except TurnError:  # classified already (an env's own EnvError, its LLM judge's JUDGE): as it is
                raise
            except Exception as exc:
                raise EnvError(ErrorClass.ENV_EXCEPTION, f"env {self.name}.{method} raised {exc!r}") from exc
        if scope is not None and scope.cancelled_caught:
            if call is not None:
                self._abandoned = call.give_up()
            raise EnvError(ErrorClass.ENV_TIMEOUT, f"env {self.name}.{method} timed out after {self.step_timeout}s")
        return result

    def _timeout(self, timeout: float | None) -> contextlib.AbstractContextManager[anyio.CancelScope | None]:
        if timeout is None:
            return _NO_TIMEOUT
        return self.deadlines.after(timeout) if self.deadlines is not None else anyio.move_on_after(timeout)

    def _method(self, method: str) -> tuple[Callable[..., Any] | None, bool]:
        """The env's callable for `method` and whether it is a coroutine function (`a<method>` first),
        looked up once per method."""
        found = self._methods.get(method)
        if found is None:
            async_fn = getattr(self.env, f"a{method}", None)
            if inspect.iscoroutinefunction(async_fn):
                found = (async_fn, True)
            else:
                found = (getattr(self.env, method, None), False)
            self._methods[method] = found
        return found


_NO_TIMEOUT = contextlib.nullcontext()


class _ThreadCall:
    """A sync env call for a worker thread, which knows, once its caller has given up on it (a timeout),
    whether it will never run (it timed out waiting for a thread) or is running, touching the env."""

    __slots__ = ("fn", "returned", "_lock", "_state")

    def __init__(self, fn: Callable[..., Any]):
        self.fn, self.returned = fn, threading.Event()  # set once `fn` has returned or raised
        self._lock, self._state = threading.Lock(), "waiting"

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            if self._state == "given up":
                return None  # its caller has gone: it never runs
            self._state = "running"
        try:
            return self.fn(*args)
        finally:
            self.returned.set()

    def give_up(self) -> threading.Event | None:
        """What to wait for before the env is called again: None where the call never ran, and never will."""
        with self._lock:
            if self._state == "waiting":
                self._state = "given up"
                return None
        return None if self.returned.is_set() else self.returned


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
