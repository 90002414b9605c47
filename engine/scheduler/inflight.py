"""How many groups a step of partial rollout keeps in flight, sized by the servers' own load.

Groups in flight are what keeps the servers busy while sessions wait on their tools: too few and slots idle,
too many and requests queue, the KV cache thrashes, and the groups a step does not return wait, their sessions
growing stale. So the size follows what the servers report (SGLang's `GET /v1/loads`: requests running and
waiting, the most they run, KV in use), additive increase, multiplicative decrease, as TCP does and as prime-rl
sizes its in-flight cap from KV usage:

    sizer = InFlightSizer(floor=target, ceiling=math.ceil(target * over_sampling))
    sizer.observe(await backend.reported_loads())   # every half second while a step generates
    sizer.step_ended(stale, sessions)               # of the sessions a step returned, how many came back stale
    goal = sizer.goal                               # groups to keep open or done

- **Room** (fewer requests running than `room` of the servers' slots and none waiting): one group more, or, until
  the first decrease, the size times `slow_start` (TCP's slow start: from the target to where the servers are
  busy in a few readings).
- **Pressure** (more requests waiting than `queued` of the slots, or KV above `kv_full`): the size times
  `decrease`.
- **Stale sessions**: the share of a step's sessions that came back stale, smoothed over steps (each step half);
  above `stale_share`, the size times `decrease` at the step's end; above `stale_hold`, no increase. The staleness
  bound itself is the scheduler's (`max_staleness`); this keeps the sessions it ends few. More in flight keeps the
  servers busier and ends steps sooner, so a long session spans more of them: this is the brake.

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
    room: float = 0.9  # running under this share of the slots, none waiting: room for more
    queued: float = 1.0  # requests waiting over this share of the slots (a whole batch more): too many in flight
    kv_full: float = 0.92  # KV in use over this share: too many in flight
    decrease: float = 0.8  # the multiplicative decrease
    slow_start: float = 1.25  # the growth per reading with room, until the first decrease (then one group)
    stale_share: float = 0.1  # steps whose sessions come back stale more than this (smoothed): fewer in flight
    stale_hold: float = 0.08  # ... more than this: no more
    groups: float = field(init=False)  # the size now
    stale: float = field(default=0.0, init=False)  # the share of a step's sessions that came back stale, smoothed
    starting: bool = field(default=True, init=False)  # no decrease yet: grow by slow_start
    changes: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0, "stale": 0}, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"in-flight groups: need 1 <= floor <= ceiling, got {self.floor} and {self.ceiling}")
        self.groups = float(self.floor)

    @property
    def goal(self) -> int:
        """Groups a step keeps open or done now."""
        return min(self.ceiling, max(self.floor, math.ceil(self.groups)))

    @property
    def holding(self) -> bool:
        """Too many sessions came back stale of late: no increase."""
        return self.stale > self.stale_hold

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
        elif running < self.room * slots and not waiting and not self.holding:
            grown = self.groups * self.slow_start if self.starting else self.groups + 1
            self.groups = min(float(self.ceiling), max(grown, self.groups + 1))
            self.changes["up"] += self.goal > before
        return self.goal > before

    def step_ended(self, stale: int, sessions: int) -> None:
        """A step returned `sessions` sessions, `stale` of them past the staleness bound."""
        if sessions:
            self.stale = (self.stale + stale / sessions) / 2
        if self.stale > self.stale_share:
            self._shrink("stale")

    def _shrink(self, why: str) -> None:
        shrunk = max(float(self.floor), self.groups * self.decrease)
        self.changes[why] += math.ceil(shrunk) < self.goal
        self.groups, self.starting = shrunk, False
