"""Fault injection: wrap any env so that its steps raise, hang past the step timeout, or return malformed
results at given rates, seeded, the same calls failing for the same seed and env every time.

    spec = FaultSpec(exception=0.01, hang=0.001, malformed_return=0.005, seed=7)
    env = inject(MyEnv(), spec, key="prompt-3/0")       # a FaultyEnv (an AsyncFaultyEnv for an env with astep)

From a config, with any env module, by naming this module as the env and the real one in `fault_injection`:

    rollout_interaction_env_path: engine.envs.faults     # slime's --custom-config-path YAML
    fault_injection:
      env_path: my_pkg.my_env      # the env that is wrapped; its build_env(sample, args) is called as usual
      seed: 0
      exception: 0.01              # share of step calls that raise
      hang: 0.001                  # share that block for hang_s (default 600 s: past the step timeout)
      malformed_return: 0.005      # share that return no (observation, done, info) triple
      subprocess: false            # true: the wrapped env runs in a child process of its own (SubprocessEnv)

slime puts the YAML's top-level keys on `args`, where `build_env` finds `args.fault_injection`. Where
`args` has no such key (`turnstile run`, whose config names only its own settings), the environment
variable TURNSTILE_FAULTS holds the settings: a YAML file's path (its `fault_injection` mapping, or the
whole file) or the mapping itself, inline (`TURNSTILE_FAULTS='{env_path: my_pkg.my_env, exception: 0.1}'`).

What each fault is, and the engine error it must surface as (`EXPECTED_ERROR`; EnvRunner classifies):

  exception              raises FaultInjected (a RuntimeError)                                 ENV_EXCEPTION
  retryable              raises EnvRetryableError                                               ENV_RETRYABLE
  hang                   blocks for `hang_s` (a sync env in its worker thread, an async one
                         asleep), which should be past the step timeout                         ENV_TIMEOUT
  malformed_return       returns None, a pair, a string or a 4-tuple instead of the triple     ENV_EXCEPTION
  malformed_observation  returns (a string / a list / a number, False, {}) as the observation  ENV_EXCEPTION
  malformed_content      returns a dict observation whose `obs_str` is not text (None, a
                         number, a list): the default format_observation passes it on, and
                         the engine cannot encode the message (stage encode)                    BAD_OBSERVATION

A faulted call replaces the wrapped env's call: the wrapped env is not stepped, so a retry of the same
step finds it as it was. Call n of a method (`step`, and `reset` when `on_reset`) of the env with key k
is faulted by one uniform draw of (seed, k, method, n), cut into the rates in the order above, so the
rates are exact probabilities and no scheduling order changes which calls fail. `key` is what makes envs
differ: `build_env` uses the sample's group index, index and prompt (`env_key`). Calls are counted per key
in a FaultLog shared by the envs of a run, so an env built again for the same trajectory goes on counting.
A hung sync call returns after `hang_s`, or at once when its env is closed (`release_hangs()` lets every
one go). The wrapper is replay safe when the wrapped env is, unless `replay_safe` says otherwise.

SubprocessEnv runs an env in a child process (its calls cross a socket): when the child dies (SIGKILL, out of
memory) every call raises EnvProcessDied, an ENV_EXCEPTION; `reset()` starts a new child only when the
SubprocessEnv was built `replay_safe=True` (the engine then replays the earlier responses into it).
FaultyReward does the same for a reward function: it raises at a rate, seeded per trajectory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from enum import StrEnum
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.envs.base import AsyncInteractionEnv, BaseInteractionEnv, default_format_observation
from engine.errors import EnvRetryableError, ErrorClass

ENV_VARIABLE = "TURNSTILE_FAULTS"
SETTINGS_KEY = "fault_injection"


class FaultKind(StrEnum):
    EXCEPTION = "exception"
    RETRYABLE = "retryable"
    HANG = "hang"
    MALFORMED_RETURN = "malformed_return"
    MALFORMED_OBSERVATION = "malformed_observation"
    MALFORMED_CONTENT = "malformed_content"


# The engine error class each fault must surface as (engine.envs.base.EnvRunner classifies them).
EXPECTED_ERROR = {
    FaultKind.EXCEPTION: ErrorClass.ENV_EXCEPTION,
    FaultKind.RETRYABLE: ErrorClass.ENV_RETRYABLE,
    FaultKind.HANG: ErrorClass.ENV_TIMEOUT,
    FaultKind.MALFORMED_RETURN: ErrorClass.ENV_EXCEPTION,
    FaultKind.MALFORMED_OBSERVATION: ErrorClass.ENV_EXCEPTION,
    FaultKind.MALFORMED_CONTENT: ErrorClass.BAD_OBSERVATION,  # the env's shape is right; encoding it fails
}
RESET_KINDS = (FaultKind.EXCEPTION, FaultKind.RETRYABLE, FaultKind.HANG)  # reset's return is not checked

MALFORMED_RETURNS: tuple[Any, ...] = (None, ({}, False), "observation", ({}, False, {}, "extra"))
MALFORMED_OBSERVATIONS: tuple[Any, ...] = ("a string", ["a", "list"], 42)
MALFORMED_CONTENTS: tuple[Any, ...] = ({"obs_str": None}, {"obs_str": 42}, {"obs_str": ["a", "list"]})


class FaultInjected(RuntimeError):
    """The exception an injected `exception` fault raises."""


class EnvProcessDied(RuntimeError):
    """A SubprocessEnv whose child process is gone."""


def uniform(*parts: Any) -> float:
    """A deterministic draw in [0, 1) from printable parts."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return (struct.unpack("<Q", digest)[0] >> 11) / float(1 << 53)


class FaultSpec(BaseModel):
    """Which faults, at what rates (each a probability per call; together at most 1), with which seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env_path: str | None = None  # the env `build_env` wraps (a module path or a .py file)
    seed: int = 0
    exception: float = Field(0.0, ge=0, le=1)
    retryable: float = Field(0.0, ge=0, le=1)
    hang: float = Field(0.0, ge=0, le=1)
    malformed_return: float = Field(0.0, ge=0, le=1)
    malformed_observation: float = Field(0.0, ge=0, le=1)
    malformed_content: float = Field(0.0, ge=0, le=1)
    hang_s: float = Field(600.0, gt=0)  # how long a hang blocks: set it past the step timeout
    on_reset: bool = False  # reset calls draw faults too (exception, retryable, hang)
    replay_safe: bool | None = None  # None: as the wrapped env says
    subprocess: bool = False  # build_env: run the wrapped env in a child process (SubprocessEnv)

    @model_validator(mode="after")
    def _at_most_one(self) -> FaultSpec:
        total = sum(self.rate(kind) for kind in FaultKind)
        if total > 1 + 1e-9:
            raise ValueError(f"the fault rates add up to {total:g}; at most 1")
        return self

    def rate(self, kind: FaultKind) -> float:
        return float(getattr(self, str(kind)))

    def draw(self, key: Any, method: str, n: int) -> FaultKind | None:
        """The fault of call `n` (0-based) of `method` on the env with `key`, or None."""
        kinds = RESET_KINDS if method == "reset" else tuple(FaultKind)
        if method == "reset" and not self.on_reset:
            return None
        u, edge = uniform(self.seed, key, method, n), 0.0
        for kind in kinds:
            edge += self.rate(kind)
            if u < edge:
                return kind
        return None


class FaultLog:
    """Call counts per env key, and counts of calls and injected faults, shared by many wrappers (thread safe).

    Give one FaultLog to every env of a run: an env built again for the same trajectory (the engine's
    recovery builds a fresh env, with the same key) then goes on counting its calls, so a retried call draws
    anew instead of meeting the same fault again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: Counter[tuple[Any, str]] = Counter()
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()

    def next_call(self, key: Any, method: str) -> int:
        """The number (0-based) of this call of `method` on envs with `key`."""
        with self._lock:
            n = self._next[(key, method)]
            self._next[(key, method)] += 1
            self.calls[method] += 1
            return n

    def note(self, kind: FaultKind) -> None:
        with self._lock:
            self.injected[str(kind)] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"calls": dict(self.calls), "injected": dict(self.injected)}


DEFAULT_LOG = FaultLog()  # build_env's: every env this process builds from a config


class _Faults:
    """The part both wrappers share: counting calls, drawing faults, the malformed values."""

    def _setup(self, env: Any, spec: FaultSpec, key: Any, formatter: Callable | None, log: FaultLog | None) -> None:
        self.env, self.spec, self.key = env, spec, key
        self.log = log if log is not None else FaultLog()
        self.injected: Counter[FaultKind] = Counter()
        self._lock = threading.Lock()
        self._format = formatter or own_formatter(env) or default_format_observation

    @property
    def replay_safe(self) -> bool:  # type: ignore[override]
        if self.spec.replay_safe is not None:
            return self.spec.replay_safe
        return bool(getattr(self.env, "replay_safe", False))

    def _next(self, method: str) -> tuple[FaultKind | None, int]:
        n = self.log.next_call(self.key, method)
        kind = self.spec.draw(self.key, method, n)
        if kind is not None:
            with self._lock:
                self.injected[kind] += 1
            self.log.note(kind)
        return kind, n

    def _bad_value(self, kind: FaultKind, n: int) -> Any:
        if kind is FaultKind.MALFORMED_RETURN:
            return MALFORMED_RETURNS[n % len(MALFORMED_RETURNS)]
        if kind is FaultKind.MALFORMED_OBSERVATION:
            return MALFORMED_OBSERVATIONS[n % len(MALFORMED_OBSERVATIONS)], False, {}
        return dict(MALFORMED_CONTENTS[n % len(MALFORMED_CONTENTS)]), False, {}

    def _raise(self, kind: FaultKind, method: str, n: int) -> None:
        where = f"{method} call {n} of env {self.key!r}"
        if kind is FaultKind.EXCEPTION:
            raise FaultInjected(f"injected exception in {where}")
        if kind is FaultKind.RETRYABLE:
            raise EnvRetryableError(f"injected retryable failure in {where}")

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        return self._format(observation)


class FaultyEnv(_Faults, BaseInteractionEnv):
    """A sync env with faults injected into its calls; see the module docstring."""

    def __init__(
        self,
        env: Any,
        spec: FaultSpec,
        *,
        key: Any = None,
        formatter: Callable | None = None,
        log: FaultLog | None = None,
    ):
        self._setup(env, spec, key, formatter, log)
        self._released = threading.Event()  # set by close() or release(): hung calls return
        with _HUNG_LOCK:
            _SYNC_WRAPPERS.add(self)

    def reset(self):
        kind, n = self._next("reset")
        if kind is not None:
            self._fault(kind, "reset", n)
        return self.env.reset()

    def step(self, response_text: str):
        kind, n = self._next("step")
        if kind is None:
            return self.env.step(response_text)
        self._fault(kind, "step", n)
        return self._bad_value(kind, n)

    def _fault(self, kind: FaultKind, method: str, n: int) -> None:
        if kind is FaultKind.HANG:
            self._released.wait(self.spec.hang_s)
            raise FaultInjected(f"injected hang in {method} call {n} of env {self.key!r} ended")
        self._raise(kind, method, n)

    def release(self) -> None:
        """Let every hung call of this env return now."""
        self._released.set()

    def close(self) -> None:
        self._released.set()
        self.env.close()


_SYNC_WRAPPERS: weakref.WeakSet[FaultyEnv] = weakref.WeakSet()
_HUNG_LOCK = threading.Lock()


def release_hangs() -> None:
    """Let every hung call of every FaultyEnv return now (a process that is done waits for no thread)."""
    with _HUNG_LOCK:
        wrappers = list(_SYNC_WRAPPERS)
    for wrapper in wrappers:
        wrapper.release()


class AsyncFaultyEnv(_Faults, AsyncInteractionEnv):
    """An async env (one with `astep`) with faults injected into its calls; see the module docstring."""

    def __init__(
        self,
        env: Any,
        spec: FaultSpec,
        *,
        key: Any = None,
        formatter: Callable | None = None,
        log: FaultLog | None = None,
    ):
        self._setup(env, spec, key, formatter, log)

    async def areset(self):
        kind, n = self._next("reset")
        if kind is not None:
            await self._fault(kind, "reset", n)
        return await _maybe_async(self.env, "reset")

    async def astep(self, response_text: str):
        kind, n = self._next("step")
        if kind is None:
            return await _maybe_async(self.env, "step", response_text)
        await self._fault(kind, "step", n)
        return self._bad_value(kind, n)

    async def _fault(self, kind: FaultKind, method: str, n: int) -> None:
        if kind is FaultKind.HANG:
            await anyio.sleep(self.spec.hang_s)
            raise FaultInjected(f"injected hang in {method} call {n} of env {self.key!r} ended")
        self._raise(kind, method, n)

    async def aclose(self) -> None:
        await _maybe_async(self.env, "close")


async def _maybe_async(env: Any, method: str, *args: Any) -> Any:
    """`env.a<method>(...)` when it is a coroutine function, else `env.<method>(...)`."""
    async_fn = getattr(env, f"a{method}", None)
    if inspect.iscoroutinefunction(async_fn):
        return await async_fn(*args)
    return getattr(env, method)(*args)


def own_formatter(env: Any) -> Callable | None:
    """The env's own format_observation, unless it is the contract's default."""
    own = getattr(env, "format_observation", None)
    if callable(own) and getattr(own, "__func__", None) is not BaseInteractionEnv.format_observation:
        return own
    return None


def inject(
    env: Any, spec: FaultSpec, *, key: Any = None, formatter: Callable | None = None, log: FaultLog | None = None
) -> FaultyEnv | AsyncFaultyEnv:
    """`env` with `spec`'s faults: an AsyncFaultyEnv when it steps by coroutine (`astep`), else a FaultyEnv."""
    cls = AsyncFaultyEnv if inspect.iscoroutinefunction(getattr(env, "astep", None)) else FaultyEnv
    return cls(env, spec, key=key, formatter=formatter, log=log)


# -- an env in a child process --------------------------------------------------------------------------


# The child: stdlib only until it unpickles `build` (which imports what the env needs), so it starts fast.
CHILD_CODE = """
import pickle, signal, sys
from multiprocessing.connection import Connection
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the parent, which closes its children
conn = Connection(int(sys.argv[1]))
try:
    env = pickle.loads(conn.recv_bytes())()
except Exception as exc:
    conn.send(("exception", f"building the env raised {exc!r}"))
    sys.exit(0)
fmt = getattr(type(env), "format_observation", None)
conn.send(("ok", fmt is not None and getattr(fmt, "__qualname__", "") != "BaseInteractionEnv.format_observation"))
while True:
    try:
        method, args = conn.recv()
    except (EOFError, OSError):
        break
    try:
        result = getattr(env, method)(*args)
    except Exception as exc:
        retryable = any(c.__name__ == "EnvRetryableError" for c in type(exc).__mro__)
        conn.send(("retryable" if retryable else "exception", f"{type(exc).__name__}: {exc}"))
    else:
        conn.send(("ok", result))
    if method == "close":
        break
"""


class SubprocessEnv(BaseInteractionEnv):
    """An env whose calls run in a child process: `build` (picklable, no arguments) makes the env there.

        env = SubprocessEnv(functools.partial(my_module.build_env, sample=sample, args=args), key="3/0")
        env.kill()        # SIGKILL the child: the call under way and every later one raise EnvProcessDied

    The child (a fresh interpreter, `sys.executable`, with this process's import path) starts at the first
    call (in the engine, `reset`, in a worker thread, under the step timeout), or at once with `start=True`
    (an env factory that the engine calls in a worker thread, `factory.blocking = True`), and builds the env
    there. Calls go over a socket one
    at a time; the env's exceptions come back as RuntimeErrors naming the original (EnvRetryableError stays
    retryable). When the child is gone every call raises EnvProcessDied; with `replay_safe=True`, `reset()`
    starts a new child first, so the engine's replay (reset, then the earlier responses again) rebuilds the
    env there. `format_observation` is the env's own, run in the child, when its class defines one, else
    `formatter` (a module's), else the default. Live instances: `SubprocessEnv.live()`.
    """

    _instances: weakref.WeakSet[SubprocessEnv] = weakref.WeakSet()
    _instances_lock = threading.Lock()
    START_TIMEOUT_S = 60.0
    FORMAT_TIMEOUT_S = 10.0

    def __init__(
        self,
        build: Callable[[], Any],
        *,
        replay_safe: bool = False,
        key: Any = None,
        formatter: Callable | None = None,
        start: bool = False,
    ):
        self.build, self.key, self.formatter = build, key, formatter
        self.replay_safe = replay_safe
        self.num_starts = 0
        self._lock = threading.Lock()  # one call at a time over the socket
        self._closed = False
        self._process: Any = None
        self._conn: Any = None
        self._custom_format = False
        self._payload = pickle.dumps(build)  # a build that does not pickle fails here, not in the child
        with SubprocessEnv._instances_lock:
            SubprocessEnv._instances.add(self)
        if start:
            with self._lock:
                self._start()

    @classmethod
    def live(cls) -> list[SubprocessEnv]:
        """Every SubprocessEnv whose child is running."""
        with cls._instances_lock:
            return [env for env in cls._instances if env.is_alive]

    def _start(self) -> None:
        """Start a child and wait until it has built the env (holding `_lock`)."""
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))}
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", CHILD_CODE, str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env
            )
        self._conn = Connection(ours.detach())
        self.num_starts += 1
        self._conn.send_bytes(self._payload)
        if not self._conn.poll(self.START_TIMEOUT_S):
            self.kill()
            raise EnvProcessDied(f"env process for {self.key!r} did not start within {self.START_TIMEOUT_S:g} s")
        status, value = self._receive()
        if status != "ok":
            raise RuntimeError(value)
        self._custom_format = bool(value)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None and not self._closed

    def kill(self) -> None:
        """SIGKILL the child (as the out-of-memory killer would)."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signal.SIGKILL)

    def _receive(self, timeout: float | None = None) -> tuple[str, Any]:
        try:
            if timeout is not None and not self._conn.poll(timeout):
                raise EnvProcessDied(
                    f"the env process of {self.key!r} (pid {self.pid}) did not answer in {timeout:g} s"
                )
            return self._conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            code = self._wait(1.0)
            raise EnvProcessDied(f"the env process of {self.key!r} (pid {self.pid}) died (exit code {code})") from exc

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        with self._lock:
            if self._closed:
                raise EnvProcessDied(f"env {self.key!r} is closed")
            if self._process is None:
                self._start()
            elif method == "reset" and self.replay_safe and self._process.poll() is not None:
                self._conn.close()
                self._start()  # a new child: the engine replays the earlier responses into it
            try:
                self._conn.send((method, args))
            except (OSError, ValueError) as exc:
                raise EnvProcessDied(f"the env process of {self.key!r} (pid {self.pid}) is gone") from exc
            status, value = self._receive(timeout)
        if status == "retryable":
            raise EnvRetryableError(value)
        if status == "exception":
            raise RuntimeError(value)
        return value

    def reset(self):
        return self._call("reset")

    def step(self, response_text: str):
        return self._call("step", response_text)

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        if self._custom_format:
            return self._call("format_observation", observation, timeout=self.FORMAT_TIMEOUT_S)
        return (self.formatter or default_format_observation)(observation)

    def close(self) -> None:
        """End the child (it is killed when it does not end by itself within a second)."""
        if self._closed:
            return
        self._closed = True
        if self._process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("close", ()))
        if self._wait(1.0) is None:
            self.kill()
            self._wait(5.0)
        self._conn.close()

    def _wait(self, timeout: float) -> int | None:
        """The child's exit code, waiting up to `timeout` for it; None if it still runs."""
        try:
            return self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


# -- a reward function that fails ------------------------------------------------------------------------


class RewardFault(RuntimeError):
    """The exception FaultyReward raises."""


class FaultyReward:
    """A reward function (`fn(trajectory)`, sync or async) that raises RewardFault on a `rate` of its calls.

    Call n for a trajectory is faulted by a draw of (seed, group id, index in group, n), so the same
    trajectories fail whatever the order they end in. `calls` and `injected` count what happened."""

    def __init__(self, fn: Callable[[Any], Any], rate: float, *, seed: int = 0):
        if not 0 <= rate <= 1:
            raise ValueError(f"rate is a probability, not {rate}")
        self.fn, self.rate, self.seed = fn, rate, seed
        self._lock = threading.Lock()
        self._per_subject: Counter[tuple[int, int]] = Counter()
        self.calls = 0
        self.injected = 0

    def __call__(self, trajectory: Any) -> Any:
        subject = (getattr(trajectory, "group_id", 0), getattr(trajectory, "index", 0))
        with self._lock:
            n = self._per_subject[subject]
            self._per_subject[subject] += 1
            self.calls += 1
            fails = uniform(self.seed, "reward", subject, n) < self.rate
            self.injected += fails
        if fails:
            raise RewardFault(f"injected reward failure, call {n} for trajectory {subject}")
        return self.fn(trajectory)


# -- from a config: build_env ------------------------------------------------------------------------------


def env_key(sample: Any) -> str:
    """What tells one trajectory's env from another's: group index, index, and a digest of the prompt."""
    prompt = getattr(sample, "prompt", None) if sample is not None else None
    digest = hashlib.blake2b(json.dumps(prompt, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()
    group = getattr(sample, "group_index", None) if sample is not None else None
    index = getattr(sample, "index", None) if sample is not None else None
    return f"{group}/{index}/{digest}"


def spec_from(args: Any = None) -> FaultSpec:
    """The settings: `args.fault_injection` (a mapping or a FaultSpec), else $TURNSTILE_FAULTS (a YAML file,
    or the mapping inline). ValueError when neither names the env to wrap."""
    given = getattr(args, SETTINGS_KEY, None) if args is not None else None
    if given is None and isinstance(args, dict):
        given = args.get(SETTINGS_KEY)
    if given is None:
        text = os.environ.get(ENV_VARIABLE)
        if not text:
            raise ValueError(
                f"engine.envs.faults needs its settings: a `{SETTINGS_KEY}:` mapping in the config (on args) or "
                f"${ENV_VARIABLE} (a YAML file or an inline mapping), naming at least env_path"
            )
        given = _parse_settings(text)
    spec = given if isinstance(given, FaultSpec) else FaultSpec.model_validate(dict(given))
    if not spec.env_path:
        raise ValueError(f"{SETTINGS_KEY}.env_path is not set: which env should faults be injected into?")
    if spec.env_path in (__name__, __file__):
        raise ValueError(f"{SETTINGS_KEY}.env_path names engine.envs.faults itself")
    return spec


@functools.lru_cache(maxsize=8)
def _parse_settings(text: str) -> FaultSpec:
    path = Path(text)
    if len(text) < 4096 and "\n" not in text and path.is_file():
        text = path.read_text()
    data = yaml.safe_load(text)
    if isinstance(data, dict) and isinstance(data.get(SETTINGS_KEY), dict):
        data = data[SETTINGS_KEY]
    if not isinstance(data, dict):
        raise ValueError(f"${ENV_VARIABLE} gives {type(data).__name__}, not a mapping of fault settings")
    return FaultSpec.model_validate(data)


def _build_inner(path: str, sample: Any, args: Any) -> Any:
    from engine.envs.loader import load_env_module

    module = load_env_module(path)
    build = getattr(module, "build_env", None)
    if not callable(build):
        raise ValueError(f"env module {path!r} has no build_env")
    try:
        inspect.signature(build).bind(sample=None, args=None)
    except TypeError:
        return build(sample, args)
    except ValueError:
        pass
    return build(sample=sample, args=args)


def _module_formatter(path: str) -> Callable | None:
    from engine.envs.loader import load_env_module

    fn = getattr(load_env_module(path), "format_observation", None)
    return fn if callable(fn) else None


def picklable(args: Any) -> Any:
    """`args` with only the attributes that pickle (slime's args carry live objects too)."""
    if args is None:
        return None
    try:
        pickle.dumps(args)
        return args
    except Exception:  # noqa: BLE001 -- any attribute that does not pickle is left out
        pass
    kept = {}
    for name, value in getattr(args, "__dict__", {}).items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001
            continue
        kept[name] = value
    return SimpleNamespace(**kept)


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> FaultyEnv | AsyncFaultyEnv:
    """The env named by the settings (`spec_from(args)`), built for `sample`, with the faults injected."""
    spec = spec_from(args)
    key = env_key(sample)
    if spec.subprocess:
        build = functools.partial(_build_inner, spec.env_path, sample, picklable(args))
        module_format = _module_formatter(spec.env_path)
        inner: Any = SubprocessEnv(build, replay_safe=bool(spec.replay_safe), key=key, formatter=module_format)
        return inject(inner, spec, key=key, log=DEFAULT_LOG)
    inner = _build_inner(spec.env_path, sample, args)
    return inject(
        inner, spec, key=key, formatter=own_formatter(inner) or _module_formatter(spec.env_path), log=DEFAULT_LOG
    )
