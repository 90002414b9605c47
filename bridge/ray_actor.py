"""The rollout service as a named Ray actor: created on first use, attached to after.

    service = attach_or_create("turnstile-rollout", settings, args)   # any process of the Ray cluster
    out = service.rollout(rollout_id, target, groups)                  # the same methods as RolloutService

The actor outlives the process that created it (`lifetime="detached"`), so paused trajectories and
their envs survive a restart of slime's rollout manager; `shutdown()` ends it. It runs its methods
on threads (`max_concurrency`), so concurrent custom-generate calls interleave on its engine.
"""

from __future__ import annotations

from typing import Any

from bridge.service import RolloutService
from bridge.settings import BridgeSettings

NAMESPACE = "turnstile"
MAX_CONCURRENCY = 1024


def attach_or_create(name: str, settings: BridgeSettings, env_args: Any = None, **service_kwargs: Any) -> RayService:
    """The actor called `name` in the `turnstile` namespace, started with `settings` if it is not running.
    Ray is initialized (`address="auto"` when a cluster is running, else locally) when it is not yet."""
    import ray

    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, namespace=NAMESPACE)
    actor = (
        ray.remote(RolloutService)
        .options(
            name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", max_concurrency=MAX_CONCURRENCY
        )
        .remote(settings, env_args, **service_kwargs)
    )
    return RayService(actor, settings)


class RayService:
    """RolloutService's blocking methods, each one a call on the actor (`agenerate` gives an ObjectRef,
    awaitable in the caller's asyncio loop)."""

    BLOCKING = frozenset({"num_held", "held_prompts", "wanted", "rollout", "evaluate", "pause", "resume", "status"})

    def __init__(self, actor: Any, settings: BridgeSettings):
        self._actor, self.settings = actor, settings

    def __getattr__(self, method: str) -> Any:
        if method not in self.BLOCKING:
            raise AttributeError(method)
        import ray

        return lambda *args: ray.get(getattr(self._actor, method).remote(*args))

    def agenerate(self, sample: Any, sampling_params: dict[str, Any]) -> Any:
        return self._actor.generate_one.remote(sample, sampling_params)

    def shutdown(self) -> None:
        """End the engine, then the actor."""
        import ray

        ray.get(self._actor.shutdown.remote())
        ray.kill(self._actor)
