"""A finished trajectory as a slime `Sample`.

slime's own `Sample` class (slime.utils.types) is used when slime is importable. Otherwise `Sample`
below, a dataclass with the same field names, types and status values as slime's for every field the
rollout path uses (SLIME_CONTRACT.md), stands in; the tests check the two agree.

The fields are written directly, never through `Sample.append_response_tokens` (which refuses
log-probs for non-trainable tokens at slime HEAD): environment tokens get loss mask 0 and log-prob 0.0,
so `loss_mask` and `rollout_log_probs` have exactly `response_length` entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine.trajectory import Status as TrajectoryStatus
from engine.trajectory import StopReason, Trajectory


@dataclass
class Sample:
    """slime's Sample, for the fields the rollout path uses (used only where slime is not importable)."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    session_id: str | None = None
    non_generation_time: float = 0.0


def sample_class() -> type:
    """slime's Sample when slime is importable, else the stand-in above."""
    try:
        from slime.utils.types import Sample as SlimeSample
    except ImportError:
        return Sample
    return SlimeSample


def to_sample(trajectory: Trajectory, tokenizer: Any, *, into: Any = None, rollout_id: int | None = None) -> Any:
    """Fill `into` (the data source's Sample for this trajectory, or a new one) from a finished trajectory."""
    trajectory.check_invariant()
    cls = sample_class()
    sample = (
        into
        if into is not None
        else cls(group_index=trajectory.group_id, index=trajectory.index, prompt=trajectory.prompt)
    )
    response = trajectory.response_ids.tolist()
    sample.tokens = trajectory.tokens.tolist()
    sample.response_length = len(response)
    sample.response = tokenizer.decode(response, skip_special_tokens=False)
    sample.loss_mask = trajectory.loss_mask.tolist()
    sample.rollout_log_probs = trajectory.logprobs.tolist()
    sample.weight_versions = trajectory.weight_versions
    sample.multimodal_train_inputs = trajectory.train_inputs.merge()
    failed = trajectory.status is TrajectoryStatus.FAILED
    sample.status = type(sample.status)(str(trajectory.status))  # the same lower-case values
    sample.remove_sample = failed  # masked out in training; the group keeps its size
    sample.reward = trajectory.reward if trajectory.reward is not None else 0.0  # slime needs one on every sample
    sample.non_generation_time = sum(t.env_seconds + t.queue_seconds + t.env_queue_seconds for t in trajectory.turns)
    if rollout_id is not None and sample.rollout_id is None:
        sample.rollout_id = rollout_id
    sample.metadata = {**(sample.metadata or {}), **_metadata(trajectory)}
    return sample


def _metadata(trajectory: Trajectory) -> dict[str, Any]:
    meta = {
        "turns": [turn.to_record() for turn in trajectory.turns],
        "num_turns": len(trajectory.turns),
        "stop_reason": str(trajectory.stop_reason),
    }
    for key in ("start_rollout_id", "num_restarts", "retries"):
        if key in trajectory.metadata:
            meta[key] = trajectory.metadata[key]
    if trajectory.errors:
        meta["errors"] = [f"{e.stage}/{e.error_class}: {e.message}" for e in trajectory.errors]
    if trajectory.stop_reason in (StopReason.ENV_ERROR, StopReason.BACKEND_ERROR):
        meta["failure"] = trajectory.errors[-1].message if trajectory.errors else str(trajectory.stop_reason)
    return meta
