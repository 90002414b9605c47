"""What the engine offers an env that runs beside it: an env whose runner is not the plain one, because it serves
something of its own on the engine (the agent envs of engine/agents/env.py serve a gateway on its scheduler).

    class MyEnv:
        def bind_runner(self, host: EnvHost, trajectory, sample, name) -> EnvRunner:
            server = host.shared(MyServer, MyServer.serving_on)   # one per engine, made by its first env
            return server.runner(self, trajectory, name)

The engine builds each trajectory's env as usual; where the env is a `HostedEnv`, the runner it returns from
`bind_runner` is the one the trajectory is driven with. The engine knows this protocol and nothing of what
implements it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from prometheus_client import CollectorRegistry

    from engine.config import EngineConfig
    from engine.envs.base import EnvRunner
    from engine.scheduler.scheduler import Scheduler
    from engine.trajectory import Trajectory

T = TypeVar("T")


class EnvHost:
    """The services of one running engine: its scheduler, its task group (what is started in it ends with the
    engine), its settings, and its metrics registry (None where /metrics is not served)."""

    def __init__(
        self, scheduler: Scheduler, tasks: TaskGroup, config: EngineConfig, registry: CollectorRegistry | None
    ):
        self.scheduler, self.tasks, self.config, self.registry = scheduler, tasks, config, registry
        self._shared: dict[Any, Any] = {}

    def shared(self, key: Any, make: Callable[[EnvHost], T]) -> T:
        """The object kept under `key` for the engine's life, made by `make(self)` the first time it is asked for."""
        if key not in self._shared:
            self._shared[key] = make(self)
        return self._shared[key]


@runtime_checkable
class HostedEnv(Protocol):
    def bind_runner(self, host: EnvHost, trajectory: Trajectory, sample: Any, name: str) -> EnvRunner:
        """The runner to drive `trajectory` with (built from `sample`, named `name`), on the engine's services."""
        ...
