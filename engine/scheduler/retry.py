"""Retry budgets and the breaker: bounded, classified retries, and a stop on admissions while errors pile up.

Each error class has a per-turn budget (how many times one turn may retry after that class of
error) and every trajectory has a total. Waits between attempts back off exponentially with full
jitter and are spent without holding a slot. A budget that runs out ends the trajectory FAILED with
the error that spent it; nothing is dropped.

The breaker watches the outcomes of recent attempts (generate calls and env steps, over a sliding
time window): while the share of failures is over its threshold, the engine admits no new prompts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from engine.errors import ErrorClass, TurnError

log = logging.getLogger(__name__)

DEFAULT_PER_TURN = {
    ErrorClass.CONNECTION: 5,
    ErrorClass.SERVER: 3,
    ErrorClass.TIMEOUT: 2,
    ErrorClass.MALFORMED: 1,
    ErrorClass.CLIENT: 0,
    ErrorClass.ENV_TIMEOUT: 2,
    ErrorClass.ENV_EXCEPTION: 1,
    ErrorClass.ENV_RETRYABLE: 3,
    ErrorClass.ENV_WORKER_LOST: 2,  # the env's worker process died: a replay_safe env is rebuilt elsewhere
    ErrorClass.AGENT: 1,  # an agent that failed before its first request starts once more
    ErrorClass.BAD_OBSERVATION: 0,
    ErrorClass.REWARD: 2,
}


class RetryPolicy(BaseModel):
    """Budgets, backoff and the env step timeout. `per_turn` maps an error class to the retries one turn
    may spend on it (classes not listed get none)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    per_turn: dict[ErrorClass, NonNegativeInt] = Field(default_factory=lambda: dict(DEFAULT_PER_TURN))
    """Retries one turn may spend per error class; a class left out gets none."""
    per_trajectory: int = Field(8, ge=0)
    """Retries a trajectory may spend in all."""
    backoff_base_s: float = Field(0.2, ge=0)
    """Backoff before retry n: uniform in [0, min(backoff_max_s, backoff_base_s * 2**n)] seconds (full jitter)."""
    backoff_max_s: float = Field(10.0, ge=0)
    """The cap of a backoff, seconds."""
    env_step_timeout_s: float | None = Field(300.0, gt=0)
    """Seconds an env's reset or step may take before it is an env_timeout error (none: no limit); the
    one env step timeout, for env runners built without one of their own."""
    reward_timeout_s: float | None = Field(300.0, gt=0)
    """Seconds one call of the reward function (a trajectory, or a group) may take (none: no limit)."""

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Seconds before retry number `attempt` (0-based): uniform in [0, min(max, base * 2**attempt)]."""
        return rng.uniform(0.0, min(self.backoff_max_s, self.backoff_base_s * 2**attempt))


class RetryBudget:
    """One trajectory's retries: per error class within the current turn, and in total."""

    __slots__ = ("policy", "total", "by_class", "_turn", "_this_turn")

    def __init__(self, policy: RetryPolicy):
        self.policy = policy
        self.total = 0  # retries spent in all
        self.by_class: dict[ErrorClass, int] = {}
        self._turn = -1
        self._this_turn: dict[ErrorClass, int] = {}  # of `_turn`; most trajectories never spend one

    def charge(self, error: TurnError, turn: int) -> int | None:
        """Spend one retry of `error` in `turn`: the attempt number to back off for, or None when a
        budget is spent (the caller fails the trajectory with `error`)."""
        if turn != self._turn:
            self._turn, self._this_turn = turn, {}
        cls = error.error_class
        spent = self._this_turn.get(cls, 0)
        if spent >= self.policy.per_turn.get(cls, 0) or self.total >= self.policy.per_trajectory:
            return None
        self._this_turn[cls] = spent + 1
        self.by_class[cls] = self.by_class.get(cls, 0) + 1
        self.total += 1
        return spent


@dataclass(frozen=True, slots=True)
class BreakerStatistics:
    is_open: bool
    attempts: int  # in the window
    failures: int
    times_opened: int


class CircuitBreaker:
    """Open while, over the last `window_s` seconds, at least `min_attempts` attempts were made and
    more than `threshold` of them failed. It closes by itself as the window moves on.

    Outcomes are counted in `BUCKETS` time buckets over the window (so memory stays flat at any turn
    rate, and the window moves on in steps of `window_s / BUCKETS`). `record` and `is_open` run on the
    engine's loop; `statistics` may be read from any thread (the Prometheus exporter's): it is a
    read-only snapshot. A lock keeps it from seeing the buckets change shape; the counts in a bucket
    are written by the loop alone, attempts before failures, so a snapshot never has more failures
    than attempts."""

    BUCKETS = 32

    def __init__(self, *, threshold: float = 0.5, window_s: float = 30.0, min_attempts: int = 20, clock=time.monotonic):
        self.threshold, self.window_s, self.min_attempts = threshold, window_s, min_attempts
        self._clock = clock
        self._resolution = window_s / self.BUCKETS
        self._buckets: deque[list[int]] = deque()  # [bucket number, attempts, failures], oldest first
        self._attempts = self._failures = 0  # over the buckets held
        self._was_open = False
        self._lock = threading.Lock()
        self.times_opened = 0

    def record(self, ok: bool) -> None:
        """One attempt's outcome; `is_open` (read before each admission) judges the window."""
        key = int(self._clock() // self._resolution)
        buckets = self._buckets
        if not buckets or buckets[-1][0] != key:
            with self._lock:
                buckets.append([key, 0, 0])
        bucket = buckets[-1]
        bucket[1] += 1
        self._attempts += 1
        if not ok:
            bucket[2] += 1
            self._failures += 1

    @property
    def is_open(self) -> bool:
        return self._update()

    def _update(self) -> bool:
        """Drop the buckets that left the window; log when the breaker opens or closes."""
        oldest = self._oldest_key()
        with self._lock:
            while self._buckets and self._buckets[0][0] < oldest:
                _, attempts, failures = self._buckets.popleft()
                self._attempts -= attempts
                self._failures -= failures
            n, failures = self._attempts, self._failures
            is_open = self._judge(n, failures)
            changed = is_open != self._was_open
            if changed:
                self._was_open = is_open
                self.times_opened += is_open
        if changed:
            if is_open:
                log.warning("breaker open: %d of the last %d attempts failed; admitting no new prompts", failures, n)
            else:
                log.warning("breaker closed (error rate %.0f%%); admitting prompts again", 100 * failures / max(n, 1))
        return is_open

    def _oldest_key(self) -> int:
        """The first bucket still (partly) inside the window."""
        return int((self._clock() - self.window_s) // self._resolution) + 1

    def _judge(self, attempts: int, failures: int) -> bool:
        return attempts >= self.min_attempts and failures > self.threshold * attempts

    def statistics(self) -> BreakerStatistics:
        """A snapshot over the current window, changing nothing."""
        oldest = self._oldest_key()
        with self._lock:
            recent = [(a, f) for key, a, f in self._buckets if key >= oldest]
            times_opened = self.times_opened
        n, failures = sum(a for a, _ in recent), sum(f for _, f in recent)
        return BreakerStatistics(self._judge(n, failures), n, failures, times_opened)
