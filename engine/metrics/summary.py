"""The per-step summary: the dict slime logs for a rollout step, plus per-turn distributions.

Keys follow slime's rollout logging (`slime/observability/rollout_metrics.py`) where they apply:
`rollout/response_len/{mean,median,max,min}`, `rollout/truncated_ratio`, `rollout/zero_std/count_<r>`,
`rollout/dynamic_filter/drop_<reason>`, `perf/rollout_time`, `perf/tokens_per_gpu_per_sec`,
`perf/longest_sample_tokens_per_sec`, `perf/non_generation_time/*`; the multi-turn part goes under
`multi_turn/` (slime's wandb setup already plots that prefix): turns per trajectory, status and
stop-reason shares, retries by class, partial-rollout counts and token staleness.
"""

from __future__ import annotations

import statistics as stats
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.trajectory import Status

if TYPE_CHECKING:
    from engine.scheduler.partial import VersionClock
    from engine.statistics import EngineStatistics
    from engine.trajectory import Group, Trajectory


def distribution(values: list[float], prefix: str) -> dict[str, float]:
    """mean / median / max / min under `prefix`, as slime's compute_statistics."""
    if not values:
        return {}
    return {
        f"{prefix}mean": stats.fmean(values),
        f"{prefix}median": float(stats.median(values)),
        f"{prefix}max": float(max(values)),
        f"{prefix}min": float(min(values)),
    }


@dataclass(frozen=True, slots=True)
class TrajectoryDigest:
    """What a step's summary reads of one returned trajectory: a few numbers, cheap to send from a shard to the
    place that sums a step over shards (bridge/shards.py)."""

    response_length: int
    effective_tokens: int  # loss mask 1
    non_generation_s: float  # env, env queue and generation queue time
    status: Status
    stop_reason: str | None
    reward: Any
    num_turns: int
    retries: dict[str, int]
    forks: tuple[int, ...]  # generated tokens of each chain its agent's session forked off it
    later_prompt_tokens: int  # prefilled by turns after the first
    later_cached_tokens: int  # of those, found in the prefix cache
    spans: tuple[tuple[str | None, int], ...]  # (weight version, tokens) of each generate call
    last_error: tuple[str, str] | None  # (error class, message) of its last error

    @classmethod
    def of(cls, t: Trajectory) -> TrajectoryDigest:
        later = t.turns[1:]  # a later turn re-sends the whole conversation
        return cls(
            response_length=t.response_length,
            effective_tokens=sum(t.loss_mask),
            non_generation_s=sum(turn.env_seconds + turn.queue_seconds + turn.env_queue_seconds for turn in t.turns),
            status=t.status,
            stop_reason=str(t.stop_reason),
            reward=t.reward,
            num_turns=len(t.turns),
            retries=dict(t.metadata.get("retries", {})),
            forks=tuple(fork.num_generated for fork in t.forks),
            later_prompt_tokens=sum(turn.prompt_tokens for turn in later),
            later_cached_tokens=sum(turn.cached_tokens for turn in later),
            spans=tuple((span.weight_version, span.length) for span in t.spans),
            last_error=t.last_error,
        )


@dataclass(frozen=True, slots=True)
class GroupDigest:
    trajectories: tuple[TrajectoryDigest, ...]

    @classmethod
    def of(cls, group: Group | GroupDigest) -> GroupDigest:
        if isinstance(group, GroupDigest):
            return group
        return cls(tuple(TrajectoryDigest.of(t) for t in group.trajectories))

    @property
    def rewards(self) -> list[Any]:
        return [t.reward for t in self.trajectories]


def step_summary(
    groups: Sequence[Group | GroupDigest],
    *,
    rollout_time: float,
    clock: VersionClock,
    after: EngineStatistics | None = None,
    before: EngineStatistics | None = None,
    counts: dict[str, Any] | None = None,
    num_gpus: int | None = None,
) -> dict[str, Any]:
    """Summarize a returned step. `before` / `after` are engine snapshots around it (counts are their
    difference), or `counts` what `step_counts` gave (summed over shards by `merged_counts`); `num_gpus` enables
    slime's per-GPU throughput keys."""
    digests = [GroupDigest.of(group) for group in groups]
    samples = [t for group in digests for t in group.trajectories]
    if not samples:
        return {"perf/rollout_time": rollout_time}
    lengths = [t.response_length for t in samples]
    effective = [t.effective_tokens for t in samples]
    out: dict[str, Any] = {}
    out |= distribution(lengths, "rollout/response_len/")
    out["rollout/truncated_ratio"] = sum(t.status is Status.TRUNCATED for t in samples) / len(samples)
    rewards = [t.reward for t in samples if isinstance(t.reward, int | float)]
    if rewards:
        out["rollout/raw_reward"] = stats.fmean(rewards)
    for group in digests:
        group_rewards = {r for r in group.rewards if isinstance(r, int | float)}
        if len(group.trajectories) > 1 and len(group_rewards) == 1:
            key = f"rollout/zero_std/count_{round(group_rewards.pop(), 1)}"
            out[key] = out.get(key, 0) + 1
    out["perf/rollout_time"] = rollout_time
    if num_gpus:
        out["perf/tokens_per_gpu_per_sec"] = sum(lengths) / rollout_time / num_gpus
        out["perf/effective_tokens_per_gpu_per_sec"] = sum(effective) / rollout_time / num_gpus
    out["perf/longest_sample_tokens_per_sec"] = max(lengths) / rollout_time
    out["perf/longest_effective_sample_tokens_per_sec"] = max(effective) / rollout_time
    out |= distribution([t.non_generation_s for t in samples], "perf/non_generation_time/")
    out |= _multi_turn(samples, clock)
    out |= counts if counts is not None else step_counts(after, before)
    return out


def _multi_turn(samples: list[TrajectoryDigest], clock: VersionClock) -> dict[str, Any]:
    out = distribution([t.num_turns for t in samples], "multi_turn/turns/")
    for status, n in Counter(str(t.status) for t in samples).items():
        out[f"multi_turn/status/{status}"] = n / len(samples)
    for reason, n in Counter(t.stop_reason for t in samples).items():
        out[f"multi_turn/stop_reason/{reason}"] = n / len(samples)
    retries: Counter[str] = Counter()
    for trajectory in samples:
        retries.update(trajectory.retries)
    for error_class, n in retries.items():
        out[f"multi_turn/retries/{error_class}"] = n
    if forks := [fork for t in samples for fork in t.forks]:  # chains an agent's session forked (engine/agents)
        out["multi_turn/agent/forks"] = len(forks)
        out["multi_turn/agent/fork_tokens_untrained"] = sum(forks)
    if prompt := sum(t.later_prompt_tokens for t in samples):
        out["multi_turn/prefix_cache/later_turns_hit_rate"] = sum(t.later_cached_tokens for t in samples) / prompt
    ages = [(clock.age(version), length) for t in samples for version, length in t.spans]
    tokens = sum(length for _, length in ages)
    if tokens:
        out["multi_turn/staleness/mean"] = sum(age * length for age, length in ages) / tokens
        out["multi_turn/staleness/max"] = max(age for age, _ in ages)
        out["multi_turn/staleness/le1_ratio"] = sum(length for age, length in ages if age <= 1) / tokens
    return out


def step_counts(after: EngineStatistics | None, before: EngineStatistics | None) -> dict[str, Any]:
    """What happened during the step: the difference of two engine snapshots."""
    if after is None:
        return {}
    a, b = after.scheduler, before.scheduler if before is not None else None

    def grew(name: str) -> int:
        return getattr(a, name) - (getattr(b, name) if b is not None else 0)

    out = {
        "multi_turn/partial/paused": grew("num_paused"),
        "multi_turn/partial/resumed": grew("num_resumed"),
        "multi_turn/partial/restarted": grew("num_restarted"),
        "multi_turn/partial/discarded_tokens": grew("num_discarded_tokens"),
        "multi_turn/partial/held_groups": after.num_groups_open + after.num_groups_done,
        "multi_turn/breaker_open": float(a.breaker.is_open),
    }
    for reason, n in after.num_groups_dropped.items():
        dropped = n - (before.num_groups_dropped.get(reason, 0) if before is not None else 0)
        if dropped:
            out[f"rollout/dynamic_filter/drop_{reason}"] = dropped
    for error_class, n in a.budgets_exhausted.items():
        spent = n - (b.budgets_exhausted.get(error_class, 0) if b is not None else 0)
        if spent:
            out[f"multi_turn/budgets_exhausted/{error_class}"] = spent
    return out


def merged_counts(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`step_counts` of several shards as one: counts summed, the breaker open where any shard's is."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = max(out.get(key, 0.0), value) if key == "multi_turn/breaker_open" else out.get(key, 0) + value
    return out
