"""How many groups a step of partial rollout keeps in flight, sized by the servers' own load.

Groups in flight are what keeps the servers busy while sessions wait on their tools: too few and slots idle,
too many and requests queue, the KV cache thrashes, and the groups a step does not return wait, their sessions
growing stale. So the size follows what the servers report (SGLang's `GET /v1/loads`: requests running and
waiting, the most they run, KV in use), additive increase, multiplicative decrease, as TCP does and as prime-rl
sizes its in-flight cap from KV usage:

    sizer = InFlightSizer(floor=target, ceiling=math.ceil(target * over_sampling))
    sizer.observe(await backend.reported_loads())   # every `interval_s` while a step generates
    sizer.step_ended(stale_share)                   # the share of the step's sessions that came back stale
    goal = sizer.goal                               # groups to keep open or done

- **Room** (fewer requests running than `room` of the servers' slots, none waiting beyond a `queued` share, KV
  below `kv_full`): one group more.
- **Pressure** (requests waiting beyond `queued` of the slots, or KV above `kv_full`): the size times `decrease`.
- **Stale sessions** (a step whose share of stale sessions is above `stale_share`): the size times `decrease`,
  and no increase until a step comes back under it. The staleness bound itself is the scheduler's
  (`max_staleness`); this keeps the sessions it would end few.

The size stays between `floor` (the step's target) and `ceiling`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.backends.base import ReportedLoad


@dataclass
class InFlightSizer:
    floor: int  # groups a step returns: never fewer in flight
    ceiling: int  # never more (over_sampling x the target, or what max_inflight holds)
    room: float = 0.9  # running under this share of the slots: room for one group more
    queued: float = 0.1  # requests waiting over this share of the slots: too many in flight
    kv_full: float = 0.92  # KV in use over this share: too many in flight
    decrease: float = 0.8  # the multiplicative decrease
    stale_share: float = 0.06  # a step with more of its sessions stale: fewer in flight
    groups: float = field(init=False)  # the size now
    holding: bool = field(default=False, init=False)  # too many sessions came back stale: no increase
    changes: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0, "stale": 0}, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"in-flight groups: need 1 <= floor <= ceiling, got {self.floor} and {self.ceiling}")
        self.groups = float(self.floor)

    @property
    def goal(self) -> int:
        """Groups a step keeps open or done now."""
        return min(self.ceiling, max(self.floor, math.ceil(self.groups)))

    def observe(self, loads: Sequence[ReportedLoad]) -> bool:
        """Size by the servers' load now; whether the goal grew."""
        slots = sum(load.max_running for load in loads)
        if slots <= 0:
            return False
        running, waiting = sum(load.running for load in loads), sum(load.waiting for load in loads)
        kv = max((load.token_usage for load in loads), default=0.0)
        before = self.goal
        if waiting > self.queued * slots or kv > self.kv_full:
            self._shrink("down")
        elif running < self.room * slots and not self.holding:
            self.groups = min(float(self.ceiling), self.groups + 1)
            self.changes["up"] += self.goal > before
        return self.goal > before

    def step_ended(self, stale: int, sessions: int) -> None:
        """A step returned `sessions` sessions, `stale` of them past the staleness bound."""
        self.holding = sessions > 0 and stale / sessions > self.stale_share
        if self.holding:
            self._shrink("stale")

    def _shrink(self, why: str) -> None:
        shrunk = max(float(self.floor), self.groups * self.decrease)
        self.changes[why] += math.ceil(shrunk) < self.goal
        self.groups = shrunk
