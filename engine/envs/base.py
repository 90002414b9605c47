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
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from engine.envs.deadlines import Deadlines
from engine.errors import EnvError, EnvRetryableError, ErrorClass, TurnError

log = logging.getLogger(__name__)


class BaseInteractionEnv:
    """slime's interaction-env contract."""

    # Set True when `reset()` followed by replaying the earlier responses rebuilds the same state,
    # so a failed step may be retried on a fresh env.
    replay_safe: bool = False
    # Set False when a step only waits for work done elsewhere (an agent program's next request): it then
    # holds no env slot, so such waits do not bound how many other envs step at once.
    needs_env_slot: bool = True
    # Set False when the trajectory may not run again from its prompt once too stale, because something
    # outside saw its earlier turns (an agent program): it then ends STALE instead (on_stale="finish").
    restartable: bool = True
    # Set True when the prompt is the env's to give, not the prompt row's (an agent program's first request):
    # `reset` then returns `{"prompt": messages, "tools": tools or None}`, and the trajectory's prompt is that.
    gives_prompt: bool = False

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
        close_timeout: float = 10.0,
    ):
        if not callable(getattr(env, "step", None)) and not callable(getattr(env, "astep", None)):
            raise TypeError(f"env {type(env).__name__} has neither step() nor astep()")
        self.env = env
        self.name = name or type(env).__name__
        self.step_timeout = step_timeout
        self.close_timeout = close_timeout  # the bound on `close`
        self.limiter = limiter  # worker threads for sync envs; None: anyio's default (40 threads)
        self.deadlines: Deadlines | None = None  # the engine's shared timeout watcher; None: a timer per call
        self.abandoned_calls: AbandonedCalls | None = None  # the engine's registry of calls left running
        self._abandoned: _ThreadCall | None = None  # a sync call that timed out, until it returns
        self._methods: dict[str, tuple[Callable[..., Any] | None, bool]] = {}
        self._format = format_observation or getattr(env, "format_observation", None) or default_format_observation

    @property
    def replay_safe(self) -> bool:
        return bool(getattr(self.env, "replay_safe", False))

    @property
    def needs_env_slot(self) -> bool:
        return bool(getattr(self.env, "needs_env_slot", True))

    @property
    def restartable(self) -> bool:
        return bool(getattr(self.env, "restartable", True))

    @property
    def gives_prompt(self) -> bool:
        return bool(getattr(self.env, "gives_prompt", False))

    @property
    def is_busy(self) -> bool:
        """A sync call that timed out is still running in its worker thread, touching the env: the env
        must not be called again (a retry needs a fresh env)."""
        return self._abandoned is not None and not self._abandoned.returned.is_set()

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

    def message(self, observation: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """The chat message for an observation, by the env's (or its module's) format_observation: one
        message, or a non-empty list of them (the results of several tool calls)."""
        try:
            message = self._format(observation)
        except Exception as exc:
            raise EnvError(ErrorClass.ENV_EXCEPTION, f"env {self.name}.format_observation raised {exc!r}") from exc
        messages = message if isinstance(message, list) and message else [message]
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise EnvError(
                ErrorClass.ENV_EXCEPTION,
                f"env {self.name}.format_observation returned {_short(message)}, expected a chat message dict "
                "or a non-empty list of them",
            )
        return message

    async def close(self, timeout: float | None = None) -> None:
        """Close the env, shielded from cancellation and bounded by `timeout` (default `close_timeout`). Raises
        EnvError.

        An env whose call timed out and still runs in its thread is not waited for: that thread closes
        it once the call returns (closing under the call could break either), and a failing close there
        is logged, its trajectory having ended."""
        if self._abandoned is not None and self._abandoned.then(self._close_in_thread):
            return
        with anyio.move_on_after(self.close_timeout if timeout is None else timeout, shield=True):
            await self._call("close")

    def _close_in_thread(self) -> None:
        """The env's close, run by the thread of its abandoned call once that call returned."""
        fn, is_async = self._method("close")
        try:
            if is_async:  # an event loop of its own, outside the context the call ran in
                contextvars.Context().run(anyio.run, fn)
            elif fn is not None:
                fn()
        except Exception:  # noqa: BLE001 -- its trajectory has ended; nothing is left to fail
            log.warning("env %s.close raised, after its call that timed out returned", self.name, exc_info=True)

    async def _call(self, method: str, *args: Any) -> Any:
        """Call the env's `a<method>` coroutine if it has one, else `<method>` in a worker thread.

        `reset` and `step` run under `step_timeout`. A sync call its caller leaves (past the timeout, or
        cancelled) is abandoned: its thread may still be running and touching the env, so `is_busy`
        holds until it returns and the env is not to be called again (retry on a fresh env)."""
        if self.is_busy:
            raise EnvError(
                ErrorClass.ENV_EXCEPTION, f"env {self.name}.{method}: an earlier call that timed out is still running"
            )
        fn, is_async = self._method(method)
        result = call = None
        timeout = None if method == "close" else self.step_timeout
        try:
            with self._timeout(timeout) as scope:
                try:
                    if is_async:
                        result = await fn(*args)
                    elif fn is not None:
                        call = _ThreadCall(fn)
                        result = await anyio.to_thread.run_sync(
                            call, *args, abandon_on_cancel=True, limiter=self.limiter
                        )
                except EnvRetryableError as exc:
                    message = f"env {self.name}.{method} asked for a retry: {exc}"
                    raise EnvError(ErrorClass.ENV_RETRYABLE, message) from exc
                except TurnError:  # classified already (an env's own EnvError, its LLM judge's JUDGE): as it is
                    raise
                except Exception as exc:
                    raise EnvError(ErrorClass.ENV_EXCEPTION, f"env {self.name}.{method} raised {exc!r}") from exc
        finally:
            if call is not None and call.give_up():  # left before it returned: it runs on in its thread
                self._abandoned = call
                if self.abandoned_calls is not None:
                    self.abandoned_calls.add(call, f"{self.name}.{method}")
        if scope is not None and scope.cancelled_caught:
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


class AbandonedCalls:
    """Sync env calls their callers left (past their timeout, or cancelled) that still run in their worker
    threads. The process waits for them when it exits (worker threads are not daemons), so whoever ends it
    can say what it is waiting for, and for how long at most (`describe`, `wait`)."""

    def __init__(self) -> None:
        self._calls: dict[_ThreadCall, str] = {}  # call -> "Env.method"
        self._lock = threading.Lock()

    def add(self, call: _ThreadCall, what: str) -> None:
        with self._lock:
            self._calls[call] = what
        if not call.then_forget(self):  # it returned meanwhile
            self.discard(call)

    def discard(self, call: _ThreadCall) -> None:
        with self._lock:
            self._calls.pop(call, None)

    def __len__(self) -> int:
        return len(self._calls)

    def describe(self) -> str:
        """`GuessEnv.step (running 28s), ...`: what still runs, longest first."""
        now = time.monotonic()
        with self._lock:
            calls = sorted(self._calls.items(), key=lambda item: item[0].started)
        return ", ".join(f"{what} (running {now - call.started:.0f}s)" for call, what in calls)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every call to return; True when none runs any more."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                call = next(iter(self._calls), None)
            if call is None:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not call.returned.wait(left):
                return False
            self.discard(call)


class _ThreadCall:
    """A sync env call for a worker thread, which knows, once its caller has given up on it (a timeout),
    whether it will never run (it timed out waiting for a thread) or is running, touching the env; what
    is left to do once it returns (close the env, leave the registry of abandoned calls) is then done by
    its thread."""

    __slots__ = ("fn", "returned", "started", "_lock", "_state", "_then", "_registry")

    def __init__(self, fn: Callable[..., Any]):
        self.fn, self.returned = fn, threading.Event()  # set once `fn` has returned or raised
        self.started = 0.0  # time.monotonic() when it started running
        self._lock, self._state = threading.Lock(), "waiting"
        self._then: Callable[[], None] | None = None
        self._registry: AbandonedCalls | None = None

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            if self._state == "given up":
                return None  # its caller has gone: it never runs
            self._state, self.started = "running", time.monotonic()
        try:
            return self.fn(*args)
        finally:
            while True:  # what was left to this thread runs before the call counts as returned (the env is busy)
                with self._lock:
                    then, self._then = self._then, None
                    if then is None:
                        self._state, registry = "returned", self._registry
                        self.returned.set()
                        break
                then()
            if registry is not None:
                registry.discard(self)

    def give_up(self) -> bool:
        """The caller has gone. True where the call runs on (the env is busy until `returned`); False where
        it never ran, and never will, or has returned already."""
        with self._lock:
            if self._state == "waiting":
                self._state = "given up"
                return False
            return self._state == "running"

    def then(self, fn: Callable[[], None]) -> bool:
        """Have this call's thread run `fn` once the call returns; False (and `fn` not kept) where it has."""
        with self._lock:
            if self._state != "running":
                return False
            self._then = fn
            return True

    def then_forget(self, registry: AbandonedCalls) -> bool:
        """Have this call's thread leave `registry` once the call returns; False where it has."""
        with self._lock:
            if self._state != "running":
                return False
            self._registry = registry
            return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
