"""Env workers: envs hosted in a pool of Ray actors instead of the rollout process's threads.

    pool = EnvWorkerPool(EnvFactory("my_pkg.my_env", args), num_workers=4, capacity=32)
    # or hosted(EnvFactory(...), env_workers=4): the factory itself where env_workers is 0
    async with RolloutEngine(..., env_factory=pool, ...) as engine: ...   # given as an EnvFactory is
    pool.close()                                                          # the workers end

Why: agentic envs are often CPU-bound Python (an interpreter, a parser, a judge). Stepped in threads
of the rollout process they share one GIL with the engine's event loop, and every other trajectory's
turn handling waits behind them. Each worker here is a process of its own holding many envs by key;
it runs their calls on its own event loop (a sync env's calls in its threads, `capacity` at once, the same
threads from call to call), so many envs step concurrently per worker and the engine's loop stays free.

The engine sees no difference. The pool is called like an EnvFactory and gives each trajectory a
`RemoteEnvRunner`, which has EnvRunner's interface (reset, step, message, close, replay_safe,
is_busy, step_timeout), so the turn-level scheduling, retries and metrics are unchanged. The env is
built by the module's `build_env`, in the least-loaded worker, when its trajectory first resets it (one
call builds and resets), and stays in that worker for the whole trajectory, paused between rollout steps
included.
`format_observation` runs in the worker with the step: the step's reply carries the chat message.

A worker that dies (killed, out of memory, its node lost) fails each call of the envs it held with
ENV_WORKER_LOST, and those envs report `is_busy`: they cannot be called again, so the scheduler
retries the trajectory on a fresh env (in a live worker, replayed) where the env is replay_safe, and
fails it otherwise. The pool starts a new worker in the dead one's place when it finds out.

Ray: the one this process is connected to (inside slime's Ray job), else `ray.init(address=...)`: an
existing cluster ("auto", or its address), or, with no address, a running local one or a new one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup

from engine.envs.base import EnvRunner, StepResult
from engine.envs.deadlines import Deadlines
from engine.envs.loader import EnvFactory
from engine.errors import EnvError, ErrorClass, user_traceback
from engine.parsers import PARSERS, OutputParser, current_parser, reasoning_open, use_parser

log = logging.getLogger(__name__)

WORKER_GRACE_S = 10.0  # past the step timeout (which the worker enforces), how long its answer may take


@dataclass(frozen=True, slots=True)
class Reply:
    """A worker's answer to one env call: its value, or the env's error as data (class, message); and
    whether a call of that env that timed out is still running there."""

    value: Any = None
    error: tuple[str, str, str | None] | None = None  # _as_data
    is_busy: bool = False


class EnvWorker:
    """One worker process (the Ray actor's class): envs by key, built by the env module's factory, each
    driven by an EnvRunner (timeouts and error classes as in process); calls of one env never overlap."""

    def __init__(self, path: str, args: Any, step_timeout: float | None, capacity: int):
        self.factory = EnvFactory(path, args, step_timeout=step_timeout)
        self.capacity = capacity
        self.envs: dict[str, tuple[EnvRunner, anyio.Lock]] = {}
        self._threads: anyio.CapacityLimiter | None = None  # made on the actor's event loop
        self._hosted = TaskHost().run  # every call's env work runs under one long-lived task

    async def pid(self) -> int:
        return os.getpid()

    async def start(self, key: str, sample: Any, step_timeout: float | None) -> Reply:
        """Build the env of `key` for `sample` (in a thread: `build_env` may block) and reset it, in one call.
        Its value is ((name, replay_safe), the reset's observation), the reset's error beside it where the
        reset failed; where the build failed, no value and the build's error."""
        try:
            runner = await self._hosted(anyio.to_thread.run_sync, self.factory, sample, limiter=self._limiter())
        except EnvError as exc:
            return Reply(error=_as_data(exc))
        runner.limiter = self._limiter()
        self.envs[key] = (runner, anyio.Lock())
        reset = await self.reset(key, step_timeout)
        return Reply(((runner.name, runner.replay_safe), reset.value), reset.error, reset.is_busy)

    async def reset(self, key: str, step_timeout: float | None) -> Reply:
        return await self._call(key, step_timeout, lambda runner: runner.reset())

    async def step(
        self,
        key: str,
        response_text: str,
        step_timeout: float | None,
        parser: str | OutputParser = "qwen25",
        in_reasoning: bool = False,
    ) -> Reply:
        """The step's (observation, done, info) and, unless done, its chat message or the format error; the
        env's tool calls read by `parser`, the model family's (`engine.parsers.use_parser`), as in process."""

        async def step(runner: EnvRunner) -> tuple[Any, ...]:
            with use_parser(parser, in_reasoning=in_reasoning):
                return await _step_and_format(runner, response_text)

        return await self._call(key, step_timeout, step)

    async def close(self, key: str) -> Reply:
        """Close the env of `key` and forget it, once a call of it still running has returned."""
        held = self.envs.pop(key, None)
        if held is None:
            return Reply()
        runner, lock = held
        return await self._hosted(_locked, lock, runner, lambda runner: runner.close())

    async def _call(self, key: str, step_timeout: float | None, call: Callable[[EnvRunner], Awaitable[Any]]) -> Reply:
        held = self.envs.get(key)
        if held is None:
            return Reply(error=(str(ErrorClass.ENV_EXCEPTION), f"env worker {os.getpid()} holds no env {key}"))
        runner, lock = held
        runner.step_timeout = step_timeout
        return await self._hosted(_locked, lock, runner, call)

    def _limiter(self) -> anyio.CapacityLimiter:
        if self._threads is None:
            self._threads = anyio.CapacityLimiter(self.capacity)
        return self._threads


class TaskHost:
    """Runs coroutines as tasks of one long-lived task group, opened on the running loop at first use.

    anyio keeps a worker thread only as long as the root task of the tree that started it, and Ray
    runs each actor call as a task of its own: a sync env call made in the call's task would start a
    thread and end it with the call (a thread started and joined for every step). Run under the host's
    task, the threads are kept from one call to the next. A caller that is cancelled stops waiting;
    what it started (an env's lock held included) runs to its end."""

    def __init__(self) -> None:
        self._host: asyncio.Task[None] | None = None  # the long-lived task
        self._ready: asyncio.Future[None] | None = None  # done once its task group is open
        self._tasks: TaskGroup | None = None

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """`await fn(*args, **kwargs)`, as a task of the host's task group; its exception is the caller's."""
        loop = asyncio.get_running_loop()
        if self._host is None:
            self._ready = loop.create_future()
            self._host = loop.create_task(self._serve())
        if not self._ready.done():
            await self._ready
        done: asyncio.Future[Any] = loop.create_future()

        async def run() -> None:
            try:
                result = await fn(*args, **kwargs)
            except asyncio.CancelledError:  # the host is shutting down
                done.cancel()
                raise
            except BaseException as exc:  # noqa: BLE001 -- the caller's to raise, never the task group's
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)

        self._tasks.start_soon(run)
        return await done

    async def _serve(self) -> None:
        async with anyio.create_task_group() as self._tasks:
            self._ready.set_result(None)
            await anyio.sleep_forever()


async def _locked(lock: anyio.Lock, runner: EnvRunner, call: Callable[[EnvRunner], Awaitable[Any]]) -> Reply:
    """`call(runner)` holding the env's lock (so calls of one env never overlap), as a Reply."""
    async with lock:
        try:
            value = await call(runner)
        except EnvError as exc:
            return Reply(error=_as_data(exc), is_busy=runner.is_busy)
    return Reply(value, is_busy=runner.is_busy)


async def _step_and_format(runner: EnvRunner, response_text: str) -> tuple[Any, ...]:
    result = await runner.step(response_text)
    message = error = None
    if not result.done:
        try:
            message = runner.message(result.observation)
        except EnvError as exc:
            error = _as_data(exc)
    return result.observation, result.done, result.info, message, error


@dataclass(eq=False, slots=True)
class _Worker:
    """One slot of the pool: its actor and how many envs it holds."""

    slot: int
    actor: Any
    num_envs: int = 0
    is_lost: bool = False


@dataclass(frozen=True, slots=True)
class EnvWorkerStatistics:
    num_workers: int
    num_envs: tuple[int, ...]  # envs held, per worker slot
    num_replaced: int  # workers found dead and started again


class EnvWorkerPool:
    """`num_workers` env workers, each running up to `capacity` env calls at once; called as an
    EnvFactory is (`pool(sample)`), it gives a RemoteEnvRunner. Raises ValueError for bad settings, no
    Ray installed, or no Ray cluster at `address`."""

    blocking = False  # a call only makes the runner; the env is built in a worker on its first reset

    def __init__(self, factory: EnvFactory, *, num_workers: int, capacity: int, address: str | None = None):
        if num_workers < 1 or capacity < 1:
            raise ValueError(f"env workers: give at least 1 worker and 1 call each, not {num_workers} and {capacity}")
        self.factory, self.capacity = factory, capacity
        self._ray = _connect(address)
        self._actor_class = self._ray.remote(EnvWorker)
        self.workers = [self._start(slot) for slot in range(num_workers)]
        self.num_replaced = 0
        self.is_closed = False

    def __call__(self, sample: Any = None) -> RemoteEnvRunner:
        return RemoteEnvRunner(self, sample)

    def place(self) -> _Worker:
        """The worker a new env goes to: the one holding the fewest (it is counted as holding one more)."""
        worker = min(self.workers, key=lambda w: w.num_envs)
        worker.num_envs += 1
        return worker

    def released(self, worker: _Worker) -> None:
        worker.num_envs -= 1

    def lost(self, worker: _Worker, cause: BaseException) -> None:
        """`worker` is dead (or unreachable): a new one takes its slot; the envs it held are gone."""
        if worker.is_lost or self.is_closed:
            return
        worker.is_lost = True
        self.workers[worker.slot] = self._start(worker.slot)
        self.num_replaced += 1
        log.warning("env worker %d was lost (%s); started a new one in its place", worker.slot, type(cause).__name__)
        self._kill(worker)

    async def pids(self) -> list[int]:
        """The process id of each worker, by slot (waits for workers still starting)."""
        return [await worker.actor.pid.remote() for worker in self.workers]

    def statistics(self) -> EnvWorkerStatistics:
        return EnvWorkerStatistics(len(self.workers), tuple(w.num_envs for w in self.workers), self.num_replaced)

    def close(self) -> None:
        """End every worker (and the envs they still hold); none is started again."""
        self.is_closed = True
        for worker in self.workers:
            self._kill(worker)

    def _start(self, slot: int) -> _Worker:
        f = self.factory
        return _Worker(slot, self._actor_class.remote(f.path, f.args, f.step_timeout, self.capacity))

    def _kill(self, worker: _Worker) -> None:
        try:
            self._ray.kill(worker.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 -- already gone, or Ray is shut down: nothing left to end
            log.debug("ending env worker %d: %r", worker.slot, exc)


def hosted(
    factory: EnvFactory, *, env_workers: int = 0, capacity: int = 16, ray_address: str | None = None
) -> EnvFactory | EnvWorkerPool:
    """Where the envs of `factory`'s module run: in this process (`factory` itself, its sync calls in the
    engine's threads) with no env workers, else in a pool of `env_workers` Ray actors running up to
    `capacity` env calls each. Close what it returns when the run ends."""
    if not env_workers:
        return factory
    return EnvWorkerPool(factory, num_workers=env_workers, capacity=capacity, address=ray_address)


class RemoteEnvRunner:
    """One trajectory's env in a worker of an EnvWorkerPool, with EnvRunner's interface. Every failure
    is an EnvError: the env's own (classified in the worker), ENV_WORKER_LOST when the worker died,
    ENV_TIMEOUT when the worker has not answered within the step timeout and WORKER_GRACE_S."""

    def __init__(self, pool: EnvWorkerPool, sample: Any):
        self.pool, self.sample = pool, sample
        self.key = uuid.uuid4().hex
        self.worker: _Worker | None = None  # set once the env is built there
        self.name = pool.factory.path  # the env's class name, once built
        self.step_timeout = pool.factory.step_timeout
        self.limiter: anyio.CapacityLimiter | None = None  # the engine's threads for in-process envs: unused
        self.deadlines: Deadlines | None = None  # the engine's timeout watcher, for the worker's answer
        self.abandoned_calls = None  # the engine's registry of sync calls left running: its calls run in the worker
        self._replay_safe = self._is_busy = False
        self._observation: Any = None  # of the last step, and its chat message or format error
        self._message: dict[str, Any] | None = None
        self._format_error: tuple[str, str, str | None] | None = None

    @property
    def replay_safe(self) -> bool:
        return self._replay_safe

    needs_env_slot = True  # a step works in a worker process
    restartable = True
    gives_prompt = False  # an agent env's gateway session lives in the engine's process: not in a worker

    @property
    def is_busy(self) -> bool:
        """The env cannot be called again: its worker is lost, or a call of it that timed out still runs."""
        return self._is_busy

    async def reset(self) -> dict[str, Any]:
        """Reset the env; its first reset also builds it, in the least-loaded worker, in the same call."""
        if self.worker is None:
            observation = await self._start()
        else:
            observation = await self._call("reset", self.step_timeout)
        return observation if isinstance(observation, dict) else {}

    async def step(self, response_text: str) -> StepResult:
        parser = current_parser()  # by name where it is a registered one; else as it is (a turn's reading, a probe's)
        observation, done, info, self._message, self._format_error = await self._call(
            "step", response_text, self.step_timeout, parser.name if PARSERS.get(parser.name) is parser else parser,
            reasoning_open(),
        )  # fmt: skip
        self._observation = observation
        return StepResult(observation, done, info)

    def message(self, observation: dict[str, Any]) -> dict[str, Any]:
        """The chat message the worker formatted for the last step's observation."""
        if self._format_error is not None:
            raise _from_data(self._format_error)
        if observation is not self._observation or self._message is None:
            raise EnvError(ErrorClass.ENV_EXCEPTION, f"env {self.name}: only its last step's observation is formatted")
        return self._message

    async def close(self, timeout: float = 10.0) -> None:
        """Close the env in its worker (shielded, bounded by `timeout`); an env whose worker is lost is gone."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        self.pool.released(worker)
        if not worker.is_lost:
            with anyio.move_on_after(timeout, shield=True):
                await self._call("close", worker=worker)

    async def _start(self) -> Any:
        """Build the env in a worker and reset it (one call); the reset's observation."""
        worker = self.pool.place()
        try:
            reply = await self._send("start", self.sample, self.step_timeout, worker=worker)
            if reply.value is None:  # not built
                _raise(reply)
        except BaseException:
            self.pool.released(worker)
            raise
        (self.name, self._replay_safe), observation = reply.value
        self.worker = worker
        _raise(reply)
        return observation

    async def _call(self, method: str, *args: Any, worker: _Worker | None = None) -> Any:
        """`method` of this env's worker; the reply's value, or its error raised as an EnvError."""
        reply = await self._send(method, *args, worker=worker)
        _raise(reply)
        return reply.value

    async def _send(self, method: str, *args: Any, worker: _Worker | None = None) -> Reply:
        """`method` of this env's worker (its own, unless given), and the worker's reply. Raises EnvError
        where the reply did not come: ENV_WORKER_LOST, ENV_TIMEOUT, or ENV_EXCEPTION where Ray could not
        carry the call. Building (`start`) and `close` are not bounded here; the worker bounds the reset."""
        worker = worker or self.worker
        unbounded = method in ("start", "close") or self.step_timeout is None
        bound = None if unbounded else self.step_timeout + WORKER_GRACE_S
        timeout = anyio.CancelScope() if bound is None else self._bound(bound)
        try:
            with timeout as scope:
                reply: Reply = await getattr(worker.actor, method).remote(self.key, *args)
        except _worker_lost() as exc:
            self._is_busy = True
            self.pool.lost(worker, exc)
            raise EnvError(
                ErrorClass.ENV_WORKER_LOST,
                f"env {self.name}: its worker {worker.slot} was lost during {method}: {_last_line(exc)}",
            ) from exc
        except Exception as exc:  # the call did not reach the env (an argument or a reply Ray cannot carry)
            raise EnvError(ErrorClass.ENV_EXCEPTION, f"env {self.name}.{method} in its worker: {exc!r}") from exc
        if scope.cancelled_caught:
            self._is_busy = True
            raise EnvError(ErrorClass.ENV_TIMEOUT, f"env {self.name}.{method}: its worker gave no answer in {bound}s")
        self._is_busy = reply.is_busy
        return reply

    def _bound(self, seconds: float) -> Any:
        return self.deadlines.after(seconds) if self.deadlines is not None else anyio.move_on_after(seconds)


def _raise(reply: Reply) -> None:
    """Raise the env's error a reply carries, as the EnvError it was in the worker."""
    if reply.error is not None:
        raise _from_data(reply.error)


def _as_data(exc: EnvError) -> tuple[str, str, str | None]:
    """An env's error as Ray carries it: class, message, and where in the env's code it was raised."""
    return str(exc.error_class), exc.message, exc.traceback or user_traceback(exc)


def _from_data(error: tuple[str, str, str | None]) -> EnvError:
    return EnvError(ErrorClass(error[0]), error[1], traceback=error[2])


def _worker_lost() -> tuple[type[BaseException], ...]:
    """Ray's errors for a call whose actor died, or whose process or node did."""
    from ray import exceptions as e

    return (e.RayActorError, e.OutOfMemoryError, e.WorkerCrashedError, e.NodeDiedError)


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _connect(address: str | None) -> Any:
    """The `ray` module, connected: to the Ray this process is in, else by `ray.init(address=address)`."""
    try:
        import ray
    except ImportError as exc:
        raise ValueError("env_workers needs Ray, which is not installed here: pip install 'turnstile[ray]'") from exc
    if not ray.is_initialized():
        _check_reachable(address)
        try:
            ray.init(address=address)
        except ConnectionError as exc:
            raise ValueError(f"env workers: no Ray cluster at ray_address {address!r}: {exc}") from exc
    return ray


def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """Raise ValueError at once where `address` is a host:port nothing answers on (ray.init would retry for
    minutes); other forms ("auto", "local", ray://...) are left to Ray."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or "/" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ValueError(f"env workers: no Ray cluster at ray_address {address!r}: cannot connect ({exc})") from exc
