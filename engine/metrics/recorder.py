"""Per-turn and per-trajectory numbers, accumulated cheaply as the engine runs.

`MetricsRecorder` is an Observer holding plain counters and fixed-bucket histograms (a `bisect` and
two additions per observation). Exporters read `snapshot()`s of them, from any thread; nothing here
knows about Prometheus.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.metrics.events import Observer

if TYPE_CHECKING:
    from engine.encoding import DriftReport
    from engine.scheduler.partial import VersionClock
    from engine.trajectory import Group, Trajectory, Turn

# 1 ms to 10 min, and 1 to 128k tokens: the ranges the quantities live in.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
TURN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128)
RETRY_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]  # observations <= each bound, then +Inf
    total: float  # sum of observed values (weighted)

    @property
    def count(self) -> float:
        return self.cumulative[-1]


class Histogram:
    """Fixed buckets; `observe(value, weight)` adds `weight` observations of `value`."""

    __slots__ = ("bounds", "_counts", "_sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self._counts = [0.0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float, weight: float = 1.0) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += weight
        self._sum += value * weight

    def snapshot(self) -> HistogramSnapshot:
        counts, running, cumulative = list(self._counts), 0.0, []
        for count in counts:
            running += count
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self._sum)


class MetricsRecorder(Observer):
    def __init__(self) -> None:
        self.generate_seconds = Histogram(SECONDS_BUCKETS)
        self.env_seconds = Histogram(SECONDS_BUCKETS)
        self.generation_queue_seconds = Histogram(SECONDS_BUCKETS)
        self.env_queue_seconds = Histogram(SECONDS_BUCKETS)
        self.generated_tokens = Histogram(TOKEN_BUCKETS)
        self.observation_tokens = Histogram(TOKEN_BUCKETS)
        self.trajectory_turns = Histogram(TURN_BUCKETS)
        self.trajectory_retries = Histogram(RETRY_BUCKETS)
        self.trained_token_staleness = Histogram(STALENESS_BUCKETS)
        self.step_seconds = Histogram(SECONDS_BUCKETS)
        self.turns: Counter[str] = Counter()  # by outcome
        self.trajectories: Counter[tuple[str, str]] = Counter()  # by (status, stop reason)
        self.groups_dropped: Counter[str] = Counter()  # by reason
        self.drift_checks: Counter[str] = Counter()  # "exact" or "drift"
        self.counts: Counter[str] = Counter()  # generated_tokens, trained_tokens, stale_tokens, groups_returned, steps
        self.prompt_tokens: Counter[str] = Counter()  # prefilled by the server, by turn: "first" or "later"
        self.cached_tokens: Counter[str] = Counter()  # of those, found in its prefix cache
        self.last_step_tokens_per_second = 0.0
        self.staleness_bound: int | None = None  # the engine's max_staleness: returned tokens past it count as stale

    def turn_ended(self, trajectory: Trajectory, turn: Turn, outcome: str) -> None:
        self.turns[outcome] += 1
        self.generate_seconds.observe(turn.generate_seconds)
        self.generation_queue_seconds.observe(turn.queue_seconds)
        self.generated_tokens.observe(turn.num_generated)
        self.counts["generated_tokens"] += turn.num_generated
        which = "first" if turn.index == 0 else "later"  # later turns re-send the conversation: affinity shows here
        self.prompt_tokens[which] += turn.prompt_tokens
        self.cached_tokens[which] += turn.cached_tokens
        if turn.env_seconds or turn.num_observation:
            self.env_seconds.observe(turn.env_seconds)
            self.env_queue_seconds.observe(turn.env_queue_seconds)
            self.observation_tokens.observe(turn.num_observation)

    def trajectory_ended(self, trajectory: Trajectory) -> None:
        self.trajectories[(str(trajectory.status), str(trajectory.stop_reason))] += 1
        self.trajectory_turns.observe(len(trajectory.turns))
        self.trajectory_retries.observe(trajectory.num_retries)

    def group_dropped(self, group: Group, reason: str) -> None:
        self.groups_dropped[reason] += 1

    def step_ended(self, groups: list[Group], seconds: float, clock: VersionClock) -> None:
        trained = stale = 0
        for trajectory in (t for group in groups for t in group.trajectories):
            for span in trajectory.spans:
                age = clock.age(span.weight_version)
                self.trained_token_staleness.observe(age, span.length)
                trained += span.length
                stale += span.length if self.staleness_bound is not None and age > self.staleness_bound else 0
        self.counts["trained_tokens"] += trained
        self.counts["stale_tokens"] += stale
        self.counts["groups_returned"] += len(groups)
        self.counts["steps"] += 1
        self.step_seconds.observe(seconds)
        self.last_step_tokens_per_second = trained / seconds if seconds > 0 else 0.0

    def drift_checked(self, trajectory: Trajectory, report: DriftReport) -> None:
        self.drift_checks["exact" if report.exact else "drift"] += 1
