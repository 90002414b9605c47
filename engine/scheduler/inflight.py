"""How many groups a step of partial rollout keeps in flight, sized by the servers' own load.

Groups in flight are what keeps the servers busy while sessions wait on their tools: too few and slots idle,
too many and requests queue, the KV cache thrashes, and the groups a step does not return wait, their sessions
growing stale. So the size follows what the servers report (SGLang's `GET /v1/loads`: requests running and
waiting, the most they run, KV in use), additive increase, multiplicative decrease, as TCP does and as prime-rl
sizes its in-flight cap from KV usage:

    sizer = InFlightSizer(floor=target, ceiling=math.ceil(target * over_sampling))
    sizer.step_began()                              # the growth a step may make is set at its start
    sizer.observe(await backend.reported_loads())   # every half second while a step generates
    sizer.step_ended(stale, sessions, doomed=..., at_risk=...)
    goal = sizer.goal                               # groups to keep open or done

- **Room** (fewer requests running than `room` of the servers' slots and none waiting): more groups, up to what
  the step may grow to: `slow_start` times its size at the step's start until the first decrease or hold (TCP's
  slow start, a step for its round trip; `reading_growth` a reading), then `step_growth` of it (one group a
  reading, one group at least).
- **Pressure** (more requests waiting than `queued` of the slots, or KV above `kv_full`): the size times
  `decrease`, at once.
- **Staleness**, at each step's end. A group admitted now shows whether it went stale only `max_staleness` steps
  later, too late to size by; so the sizer reads it ahead, off the sessions still running: `doomed` (as old as the
  bound allows: they end STALE at their next turn after the update) and `at_risk` (a version younger: they will,
  unless they end within the next step). Of the step's returned sessions, the doomed share (or the share that did
  come back stale, smoothed, where higher) above `stale_share` shrinks the size by `stale_decrease`; above
  `stale_hold`, or at-risk sessions above `at_risk_hold` of them, no growth in the next step. More in flight keeps
  the servers busier and ends steps sooner, so a long session spans more of them: this is the brake.

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
    decrease: float = 0.8  # the multiplicative decrease under pressure
    slow_start: float = 2.0  # the most a step grows the size by, until the first decrease or hold
    step_growth: float = 0.1  # ... after it (one group at least)
    reading_growth: float = 1.25  # a reading with room grows the size by this, up to the step's most, while starting
    stale_share: float = 0.1  # doomed (or stale, smoothed) sessions over this share of a step's: fewer in flight
    stale_decrease: float = 0.9  # ... by this
    stale_hold: float = 0.08  # ... over this share: no growth in the next step
    at_risk_hold: float = 0.25  # sessions a version from doomed over this share of a step's: no growth either
    groups: float = field(init=False)  # the size now
    stale: float = field(default=0.0, init=False)  # the share of a step's sessions that came back stale, smoothed
    starting: bool = field(default=True, init=False)  # no decrease or hold yet: grow by slow_start
    holding: bool = field(default=False, init=False)  # the last step's end said: no growth
    cap: float = field(init=False)  # the most this step may grow the size to
    changes: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0, "stale": 0}, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"in-flight groups: need 1 <= floor <= ceiling, got {self.floor} and {self.ceiling}")
        self.groups = float(self.floor)
        self.step_began()

    @property
    def goal(self) -> int:
        """Groups a step keeps open or done now."""
        return min(self.ceiling, max(self.floor, math.ceil(self.groups)))

    def step_began(self) -> None:
        """A step starts: how far it may grow the size (none while holding)."""
        if self.holding:
            self.cap = self.groups
        elif self.starting:
            self.cap = max(self.groups * self.slow_start, self.groups + 1)
        else:
            self.cap = self.groups + max(1.0, self.groups * self.step_growth)

    def observe(self, loads: Sequence[ReportedLoad]) -> bool:
        """Size by the servers' load now; whether the goal grew."""
        slots = sum(load.max_running for load in loads)
        if slots <= 0:
            return False
        running, waiting = sum(load.running for load in loads), sum(load.waiting for load in loads)
        kv = max((load.token_usage for load in loads), default=0.0)
        before = self.goal
        if waiting > self.queued * slots or kv > self.kv_full:
            self._shrink("down", self.decrease)
        elif running < self.room * slots and not waiting and self.groups < self.cap:
            grown = self.groups * self.reading_growth if self.starting else self.groups + 1
            self.groups = min(float(self.ceiling), self.cap, max(grown, self.groups + 1))
            self.changes["up"] += self.goal > before
        return self.goal > before

    def step_ended(self, stale: int, sessions: int, *, doomed: int = 0, at_risk: int = 0) -> None:
        """A step returned `sessions` sessions, `stale` of them past the staleness bound; of those still running,
        `doomed` are as old as the bound allows, `at_risk` a version younger."""
        if not sessions:
            return
        self.stale = (self.stale + stale / sessions) / 2
        signal = max(self.stale, doomed / sessions)
        self.holding = signal > self.stale_hold or at_risk / sessions > self.at_risk_hold
        if signal > self.stale_share:
            self._shrink("stale", self.stale_decrease)
        self.starting = self.starting and not self.holding

    def _shrink(self, why: str, by: float) -> None:
        shrunk = max(float(self.floor), self.groups * by)
        self.changes[why] += math.ceil(shrunk) < self.goal
        self.groups, self.starting = shrunk, False
