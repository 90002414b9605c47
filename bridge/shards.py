"""The rollout service in shards: N services, each an engine in a process of its own, and one place that decides.

One engine process is one event loop; past what it can feed, the work runs on shards (Ray actors, each a
RolloutService with its own trajectories, envs, agent sessions and gateway) over the same servers, while this
object, in slime's rollout process, keeps the decisions:

- where each new prompt group goes: to the shard holding the fewest groups (a group's members stay on one shard,
  so group rewards and filters see the whole group);
- each shard's share of the step's target, and so of the groups it keeps in flight (over_sampling, or in_flight
  auto, within that share);
- when the step ends: once the shards hold `target` finished groups between them, it takes exactly that many,
  spread over the shards, and every shard pauses; the rest (finished, open, paused with their envs) stay on
  their shards for the next step;
- the step's summary, summed over the shards' digests; pause and resume for weight updates, on every shard.

    shards = [attach_or_create(f"turnstile-rollout-shard-{i}", settings.for_shard(i), args) for i in range(4)]
    service = ShardedService(shards, settings)
    out = service.rollout(rollout_id, target, groups)   # RolloutService's methods

A shard that dies (its actor killed, its node lost) is created again by its RayService, which queues every group
it held unreturned in the new one and begins the step there again: no prompt is lost.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from bridge.service import EvalDataset, Progress, StepOutput, StepPart
from bridge.settings import BridgeSettings
from engine.engine import StepFailedError
from engine.metrics.summary import merged_counts, step_summary

POLL_S = 0.5  # how long one watch of a shard's progress waits for news before asking again

log = logging.getLogger(__name__)

T = TypeVar("T")


class Shard(Protocol):
    """What the coordinator calls on a shard: a RolloutService, or a RayService in front of one."""

    def num_held(self) -> int: ...
    def held_prompts(self) -> list[int | None]: ...
    def queue(self, groups: list[tuple[int, list[Any]]]) -> None: ...
    def begin(self, rollout_id: int, target: int, groups: list[list[Any]]) -> None: ...
    def progress(self, seen: int, timeout_s: float) -> Progress: ...
    def finish(self, take: int) -> StepOutput: ...
    def pause(self) -> None: ...
    def resume(self, weight_version: str | None = None) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def evaluate(self, datasets: dict[str, EvalDataset]) -> dict[str, dict[str, list]]: ...
    def agenerate(self, sample: Any, sampling_params: dict[str, Any]) -> Any: ...
    def generate_one(self, sample: Any, sampling_params: dict[str, Any]) -> Any: ...
    def shutdown(self) -> None: ...


@dataclass
class _StepSum:
    """A step as summed over shards: every call of the same `rollout_id` so far."""

    rollout_id: int
    started: float
    parts: list[StepPart] = field(default_factory=list)


class ShardedService:
    def __init__(self, shards: Sequence[Shard], settings: BridgeSettings):
        if not shards:
            raise ValueError("a sharded service needs at least one shard")
        self.shards, self.settings = list(shards), settings
        self._calls = ThreadPoolExecutor(max_workers=2 * len(self.shards), thread_name_prefix="turnstile-shard")
        self._step: _StepSum | None = None
        self._held: list[int] | None = None  # each shard's held groups, as its last call said (None: ask)

    # -- what is held ----------------------------------------------------------------------------
    def num_held(self) -> int:
        return sum(self._held_by_shard())

    def _held_by_shard(self) -> list[int]:
        """Each shard's held groups. Only this service's calls change them (a shard created again holds what the
        dead one did), so what a step's `finish` said stands until the next call that queues groups."""
        if self._held is None:
            self._held = self._each(lambda shard: shard.num_held())
        return list(self._held)

    def held_prompts(self) -> list[int | None]:
        indices = [i for held in self._each(lambda shard: shard.held_prompts()) for i in held]
        return sorted(indices, key=lambda i: (i is None, i))

    def wanted(self, target: int) -> int:
        """As RolloutService.wanted, over every shard's held groups."""
        return max(0, self.settings.step_groups(target)[1] - self.num_held())

    def queue(self, groups: list[tuple[int, list[Any]]]) -> None:
        placed = place(len(groups), self._held_by_shard())
        self._held = None
        self._each_indexed(lambda i, shard: shard.queue([groups[j] for j in placed[i]]) if placed[i] else None)

    # -- steps -----------------------------------------------------------------------------------
    def rollout(self, rollout_id: int, target: int, groups: list[list[Any]]) -> StepOutput:
        """RolloutService.rollout over the shards: `target` finished groups, whole, from whichever shards finish
        them first; fewer when every shard's prompts run out."""
        if self._step is None or self._step.rollout_id != rollout_id:
            self._step = _StepSum(rollout_id, time.monotonic())
        rounds: list[list[StepOutput]] = []
        returned = 0
        while True:  # one round, or more where a shard died between counting its groups and returning them
            rounds.append(self._round(rollout_id, target - returned, groups))
            groups, got = [], sum(len(out.samples) for out in rounds[-1])
            returned += got
            if returned >= target or got == 0 or not sum(out.num_held for out in rounds[-1]):
                break
        outs = [out for round_ in rounds for out in round_]
        parts = [out.part for out in outs if out.part is not None]
        self._step.parts += parts
        StepFailedError.check([g for part in parts for g in part.groups], self.settings.max_failed_share)
        metrics = step_summary(
            [g for part in self._step.parts for g in part.groups], rollout_time=time.monotonic() - self._step.started,
            clock=parts[-1].clock, counts=merged_counts([part.counts for part in self._step.parts]),
            num_gpus=self.settings.num_gpus,
        )  # fmt: skip
        return StepOutput(
            samples=[group for out in outs for group in out.samples],
            metrics=metrics,
            num_held=sum(out.num_held for out in rounds[-1]),
            dropped=[group for out in outs for group in out.dropped],
        )

    def _round(self, rollout_id: int, target: int, groups: list[list[Any]]) -> list[StepOutput]:
        """New groups placed, every shard's step begun, watched until the shards have `target` finished groups
        between them (or run dry), and finished: each shard's output."""
        held = self._held_by_shard()
        placed = place(len(groups), held)
        targets = shares(target, [h + len(p) for h, p in zip(held, placed, strict=True)])
        self._held = None  # until the shards say again
        self._each_indexed(lambda i, shard: shard.begin(rollout_id, targets[i], [groups[j] for j in placed[i]]))
        takes = spread(target, self._watch(target))
        outs = self._each_indexed(lambda i, shard: shard.finish(takes[i]))
        self._held = [out.num_held for out in outs]
        return outs

    def _watch(self, target: int) -> list[int]:
        """Each shard's finished groups, once they make `target` between them or no shard runs any more."""
        n = len(self.shards)
        done, running = [0] * n, [True] * n
        changed, over = threading.Condition(), threading.Event()

        def watch(i: int) -> None:
            seen = -1
            try:
                while not over.is_set():
                    progress = self.shards[i].progress(seen, POLL_S)
                    with changed:
                        done[i], running[i] = progress.done, progress.running
                        changed.notify_all()
                    if not progress.running:
                        return
                    seen = progress.done
            except Exception:  # a shard that cannot be watched: the step goes on with the others
                log.exception("rollout shard %d could not be watched; the step goes on without it", i)
                with changed:
                    running[i] = False
                    changed.notify_all()

        watchers = [self._calls.submit(watch, i) for i in range(n)]
        with changed:
            changed.wait_for(lambda: sum(done) >= target or not any(running))
            seen = list(done)
        over.set()
        del watchers  # each ends with its shard's step, which `finish` ends next
        return seen

    def agenerate(self, sample: Any, sampling_params: dict[str, Any]) -> Any:
        """RolloutService.agenerate on the sample's shard (by its index: the same sample, the same shard)."""
        return self._shard_of(sample).agenerate(sample, sampling_params)

    def generate_one(self, sample: Any, sampling_params: dict[str, Any]) -> Any:
        return self._shard_of(sample).generate_one(sample, sampling_params)

    def _shard_of(self, sample: Any) -> Shard:
        return self.shards[(getattr(sample, "index", None) or 0) % len(self.shards)]

    def evaluate(self, datasets: dict[str, EvalDataset]) -> dict[str, dict[str, list]]:
        """Evaluation runs on the first shard (an engine of its own per dataset, as in one service)."""
        return self.shards[0].evaluate(datasets)

    # -- weight updates and lifetime -------------------------------------------------------------
    def pause(self) -> None:
        self._each(lambda shard: shard.pause())

    def resume(self, weight_version: str | None = None) -> None:
        self._each(lambda shard: shard.resume(weight_version))

    def status(self) -> dict[str, Any]:
        each = self._each(lambda shard: shard.status())
        summed = ("groups_open", "groups_done", "groups_returned", "prompts_queued", "trajectories_inflight")
        out: dict[str, Any] = {key: sum(status[key] for status in each) for key in summed}
        out["weight_version"] = each[0]["weight_version"]
        out["shards"] = each
        return out

    def shutdown(self) -> None:
        try:
            self._each(lambda shard: shard.shutdown())
        finally:
            self._calls.shutdown(wait=False, cancel_futures=True)

    def _each(self, call: Callable[[Shard], T]) -> list[T]:
        return self._each_indexed(lambda _, shard: call(shard))

    def _each_indexed(self, call: Callable[[int, Shard], T]) -> list[T]:
        """`call` on every shard at once (each a blocking call: a Ray round trip, or the engine's thread)."""
        futures = [self._calls.submit(call, i, shard) for i, shard in enumerate(self.shards)]
        return [future.result() for future in futures]


def place(num_groups: int, held: Sequence[int]) -> list[list[int]]:
    """Which shard each of `num_groups` new groups goes to (their indices, per shard): the one holding the fewest."""
    load, placed = list(held), [[] for _ in held]
    for j in range(num_groups):
        i = min(range(len(load)), key=lambda k: (load[k], k))
        placed[i].append(j)
        load[i] += 1
    return placed


def shares(target: int, held: Sequence[int]) -> list[int]:
    """Each shard's share of a step's `target`, by the groups it holds (rounded up, so that every shard holding a
    group keeps it in flight); an even split where none holds any."""
    total = sum(held)
    if total == 0:
        return [math.ceil(target / len(held))] * len(held)
    return [math.ceil(target * h / total) for h in held]


def spread(target: int, done: Sequence[int]) -> list[int]:
    """How many finished groups to take from each shard: `target` (or all there are), one from each in turn."""
    takes, left = [0] * len(done), min(target, sum(done))
    while left:
        for i, n in enumerate(done):
            if left and takes[i] < n:
                takes[i] += 1
                left -= 1
    return takes


def ray_shards(settings: BridgeSettings, env_args: Any = None) -> ShardedService:
    """`settings.shards` RolloutServices, each a named Ray actor (`<ray_actor>-shard-<i>`, created on first use,
    attached to after), behind one ShardedService."""
    from bridge.ray_actor import attach_or_create

    prefix = settings.ray_actor or "turnstile-rollout"
    shards = [attach_or_create(f"{prefix}-shard-{i}", settings.for_shard(i), env_args) for i in range(settings.shards)]
    log.info("the rollout runs on %d shards: %s-shard-0 .. %d", len(shards), prefix, len(shards) - 1)
    return ShardedService(shards, settings)
