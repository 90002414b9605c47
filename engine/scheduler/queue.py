"""Slots handed out by priority, the policies that decide which ready turn goes next, and the phases
an in-flight trajectory moves through (with the scheduler's statistics snapshot).

A `PriorityLimiter` is a capacity limiter (at most `total` holders) whose waiters are served lowest
key first, ties in arrival order. It can be closed: holders keep their slots, waiters wait until it
opens again. Each time it opens the epoch grows, and the epoch leads every key, so whoever waited
through a pause (paused trajectories) is served before anyone who arrives after it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import anyio

from engine.errors import ErrorClass
from engine.scheduler.retry import BreakerStatistics
from engine.trajectory import Trajectory


class Policy(StrEnum):
    FIFO = "fifo"  # turns in the order they became ready
    GROUP_COMPLETION = "group_completion"  # members of the groups with the fewest unfinished members first
    OLDEST = "oldest"  # the earliest-admitted trajectories first: bounds staleness and the tail


def priority_key(policy: Policy, trajectory: Trajectory, group_left: Callable[[Trajectory], int]) -> tuple[int, ...]:
    """The key a ready turn waits with (lower goes first); arrival order breaks ties."""
    if policy is Policy.GROUP_COMPLETION:
        return (group_left(trajectory),)
    if policy is Policy.OLDEST:
        return (trajectory.id,)
    return ()


@dataclass(frozen=True, slots=True)
class LimiterStatistics:
    total: int
    borrowed: int
    waiting: int
    is_closed: bool


class PriorityLimiter:
    """At most `total` concurrent holders; waiters served by (epoch, key, arrival)."""

    def __init__(self, total: int, *, name: str = "slots"):
        if total < 1:
            raise ValueError(f"{name}: total must be at least 1, got {total}")
        self.name = name
        self.total = total
        self.borrowed = 0
        self.epoch = 0
        self.is_closed = False
        self._waiters: list[list[Any]] = []  # heap of [epoch, key, seq, event, live]
        self._seq = itertools.count()
        self._num_waiting = 0

    async def acquire(self, key: tuple | Callable[[Any], tuple] = (), item: Any = None) -> None:
        """A slot; when none is free, wait with `key` (or `key(item)`: computed only then)."""
        if not self.is_closed and self.borrowed < self.total and not self._num_waiting:
            self.borrowed += 1
            return
        entry = [self.epoch, key(item) if callable(key) else key, next(self._seq), anyio.Event(), True]
        heapq.heappush(self._waiters, entry)
        self._num_waiting += 1
        try:
            await entry[3].wait()
        except BaseException:
            if entry[3].is_set():  # granted as we were cancelled: hand the slot on
                self.release()
            else:
                entry[4] = False
                self._num_waiting -= 1
            raise

    def release(self) -> None:
        if self.borrowed <= 0:
            raise RuntimeError(f"{self.name}: release without a holder")
        self.borrowed -= 1
        self._grant()

    def close(self) -> None:
        """Stop granting; holders keep their slots. Waiters, and whoever comes next, wait for `open`."""
        self.is_closed = True

    def open(self) -> None:
        if self.is_closed:
            self.is_closed = False
            self.epoch += 1
            self._grant()

    def set_total(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"{self.name}: total must be at least 1, got {total}")
        self.total = total
        self._grant()

    def statistics(self) -> LimiterStatistics:
        return LimiterStatistics(self.total, self.borrowed, self._num_waiting, self.is_closed)

    def _grant(self) -> None:
        while not self.is_closed and self.borrowed < self.total and self._waiters:
            entry = heapq.heappop(self._waiters)
            if not entry[4]:
                continue
            self._num_waiting -= 1
            self.borrowed += 1
            entry[3].set()


class Phase(StrEnum):
    """Where an in-flight trajectory is."""

    WAITING_TO_GENERATE = "waiting_to_generate"
    GENERATING = "generating"
    WAITING_FOR_ENV = "waiting_for_env"
    IN_ENV = "in_env"
    PAUSED = "paused"
    SCORING = "scoring"  # ended, its reward (or its group's) being computed


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    phases: dict[Phase, int]
    longest_in_phase: dict[Phase, float]  # seconds the longest-waiting trajectory has been in each phase
    generation: LimiterStatistics
    env: LimiterStatistics
    breaker: BreakerStatistics
    retries: dict[ErrorClass, int]
    budgets_exhausted: dict[ErrorClass, int]
    num_paused: int  # times a trajectory was parked by a pause
    num_resumed: int
    num_restarted: int  # restarts for staleness
    num_finished_stale: int
    num_discarded_tokens: int  # generated, then thrown away by restarts
    num_listener_failures: int  # token listeners that raised (and were cleared)
