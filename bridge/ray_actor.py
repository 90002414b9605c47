"""The rollout service as a named Ray actor: created on first use, attached to after.

    service = attach_or_create("turnstile-rollout", settings, args)   # any process of the Ray cluster
    out = service.rollout(rollout_id, target, groups)                  # the same methods as RolloutService

The actor outlives the process that created it (`lifetime="detached"`), so paused trajectories and
their envs survive a restart of slime's rollout manager; `shutdown()` ends it. It runs its methods
on threads (`max_concurrency`), so concurrent custom-generate calls interleave on its engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from functools import partial
from types import EllipsisType
from typing import Any

from bridge.service import RolloutService
from bridge.settings import BridgeSettings

NAMESPACE = "turnstile"
MAX_CONCURRENCY = 1024
RESTART_TIMEOUT_S = 60.0  # for a dead actor's name to be freed, before creating it again

log = logging.getLogger(__name__)


def attach_or_create(name: str, settings: BridgeSettings, env_args: Any = None, **service_kwargs: Any) -> RayService:
    """The actor called `name` in the `turnstile` namespace, started with `settings` if it is not running.
    Ray is initialized (`address="auto"` when a cluster is running, else locally) when it is not yet."""
    import ray

    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, namespace=NAMESPACE)
    create = partial(_actor, name, settings, env_args, service_kwargs)
    return RayService(create(), settings, name=name, create=create)


def _actor(name: str, settings: BridgeSettings, env_args: Any, service_kwargs: dict[str, Any]) -> Any:
    import ray

    return (
        ray.remote(RolloutService)
        .options(
            name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", max_concurrency=MAX_CONCURRENCY
        )
        .remote(settings, env_args, **service_kwargs)
    )


class RayService:
    """RolloutService's blocking methods, each one a call on the actor (`agenerate` gives an ObjectRef,
    awaitable in the caller's asyncio loop).

    Every prompt group handed to `rollout` (or, for a shard, `queue` and `begin`) and not yet returned (or
    dropped) is kept here too. When the actor dies (its node lost, the process killed), the next call creates
    it again by name and queues those groups in the new one before going on (and begins again a shard's step
    that was running): their paused trajectories and envs died with the actor and run again from the prompt,
    but no prompt is lost."""

    BLOCKING = frozenset({"num_held", "held_prompts", "wanted", "evaluate", "pause", "resume", "status", "progress"})

    def __init__(self, actor: Any, settings: BridgeSettings, *, name: str = "", create: Any = None):
        self._actor, self.settings, self.name, self._create = actor, settings, name, create
        # (group_index, index) of its first sample -> (the step that took it, the group)
        self._held: dict[tuple[Any, Any], tuple[int, list[Any]]] = {}
        self._begun: tuple[int, int] | None = None  # a shard's step begun and not finished: (rollout_id, target)
        self._restarting = threading.Lock()
        self._generation = 0  # actors made so far, less one: which one a call went to
        self.restarts = 0

    def __getattr__(self, method: str) -> Any:
        if method not in self.BLOCKING:
            raise AttributeError(method)
        return lambda *args: self._call(method, *args)

    def rollout(self, rollout_id: int, target: int, groups: list[list[Any]]) -> Any:
        self._hold((rollout_id, group) for group in groups)
        # a new actor has these queued by the restart
        out = self._call("rollout", rollout_id, target, groups, after_restart=(rollout_id, target, []))
        return self._returned(out)

    # a shard's step (bridge/shards.py); a shard that dies meanwhile begins it again, its held groups queued
    def queue(self, groups: list[tuple[int, list[Any]]]) -> None:
        self._hold(groups)
        self._call("queue", groups, after_restart=([],))

    def begin(self, rollout_id: int, target: int, groups: list[list[Any]]) -> None:
        self._hold((rollout_id, group) for group in groups)
        self._begun = (rollout_id, target)
        self._call("begin", rollout_id, target, groups, after_restart=None)  # the restart begins it

    def finish(self, take: int) -> Any:
        out = self._call("finish", take)
        self._begun = None
        return self._returned(out)

    def _hold(self, groups: Iterable[tuple[int, list[Any]]]) -> None:
        """Keep these groups (each with the step that took it) until a step returns or drops them."""
        self._held.update((_key(group), (rollout_id, group)) for rollout_id, group in groups)

    def _returned(self, out: Any) -> Any:
        """A step's output: its groups, returned or dropped, are no longer held."""
        for group in [*out.samples, *out.dropped]:
            self._held.pop(_key(group), None)
        return out

    def agenerate(self, sample: Any, sampling_params: dict[str, Any]) -> Any:
        return self._actor.generate_one.remote(sample, sampling_params)

    def shutdown(self) -> None:
        """End the engine, then the actor."""
        import ray

        ray.get(self._actor.shutdown.remote())
        ray.kill(self._actor)

    def _call(self, method: str, *args: Any, after_restart: tuple[Any, ...] | EllipsisType | None = ...) -> Any:
        """`method` on the actor. Where the actor died, it is created again (once, however many calls saw it die)
        and `method` called on the new one with `after_restart` (default: the same arguments; None: not again)."""
        import ray

        generation = self._generation
        try:
            return ray.get(getattr(self._actor, method).remote(*args))
        except _actor_died() as exc:
            self._restart(exc, generation)
        if after_restart is None:
            return None
        return ray.get(getattr(self._actor, method).remote(*(args if after_restart is ... else after_restart)))

    def _restart(self, exc: BaseException, generation: int) -> None:
        """A new actor in place of the dead one, holding every group the dead one held unreturned, and running
        the shard's step that was running there; nothing where another call has made it since the actor of
        `generation` died."""
        import ray

        if self._create is None:
            raise exc
        with self._restarting:
            if generation != self._generation:
                return
            log.warning(
                "the rollout service's actor %r died (%s); creating it again and queueing the %d prompt groups it held",
                self.name, type(exc).__name__, len(self._held),
            )  # fmt: skip
            deadline = time.monotonic() + RESTART_TIMEOUT_S
            while True:  # the dead actor's name is freed shortly after its death
                try:
                    ray.get_actor(self.name, namespace=NAMESPACE)
                except ValueError:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the dead actor {self.name!r} still holds its name after {RESTART_TIMEOUT_S:g} s"
                    ) from exc
                time.sleep(0.1)
            actor = self._create()
            ray.get(actor.queue.remote(list(self._held.values())))
            if self._begun is not None:  # a shard's step was running on the dead one
                ray.get(actor.begin.remote(*self._begun, []))
            self._actor = actor
            self._generation += 1
            self.restarts += 1


def _key(group: list[Any]) -> tuple[Any, Any]:
    return (group[0].group_index, group[0].index)


def _actor_died() -> type[BaseException]:
    from ray.exceptions import RayActorError

    return RayActorError
