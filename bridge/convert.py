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
from engine.trajectory import Trajectory


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


def to_sample(trajectory: Trajectory, tokenizer: Any, *, into: Any = None) -> Any:
    """Fill `into` (the data source's Sample for this trajectory, or a new one) from an ended trajectory.

    `rollout_id` is left as the data source gave it (slime's data source: None, so slime's trainer
    counts each sample as a rollout of its own); it names a trajectory in slime, never a step. The reward
    is the env's (`info["reward"]`) or None, for slime's reward path to fill; `settle` writes the rest."""
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
    sample.reward = trajectory.reward
    sample.non_generation_time = sum(t.env_seconds + t.queue_seconds + t.env_queue_seconds for t in trajectory.turns)
    if getattr(sample, "session_id", None) is None:
        sample.session_id = trajectory.session_id
    cache = getattr(sample, "prefix_cache_info", None)  # slime's own Sample: the prefix cache statistics it logs
    if cache is not None:
        cache.cached_tokens = sum(t.cached_tokens for t in trajectory.turns)
        cache.total_prompt_tokens = sum(t.prompt_tokens for t in trajectory.turns)
    spec, counts = getattr(sample, "spec_info", None), trajectory.metadata.get("spec_info")
    if spec is not None and counts:  # speculative decoding's counts, for slime's spec_accept_* metrics
        spec.spec_accept_token_num = counts["spec_accept_token_num"]
        spec.spec_draft_token_num = counts["spec_draft_token_num"]
        spec.spec_verify_ct = counts["spec_verify_ct"]
        spec.completion_token_num = counts["completion_tokens"]
    return settle(sample, trajectory, fill_reward=False)


def settle(sample: Any, trajectory: Trajectory, *, fill_reward: bool = True) -> Any:
    """The fields that may change after conversion (a group reward fails its members): status,
    `remove_sample`, reward and the outcome in metadata.

    Samples that must not train get `remove_sample=True`: FAILED ones, and ABORTED ones (finished for
    staleness, or cut by shutdown). slime's trainer still needs a number in their reward: with
    `fill_reward`, 0.0 where there is none."""
    sample.status = type(sample.status)(str(trajectory.status))  # the same lower-case values
    sample.remove_sample = trajectory.status in (TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED)
    if trajectory.reward is not None:
        sample.reward = trajectory.reward
    if fill_reward and sample.remove_sample and sample.reward is None:
        sample.reward = 0.0
    sample.metadata = {**(sample.metadata or {}), **_metadata(trajectory)}
    return sample


def _metadata(trajectory: Trajectory) -> dict[str, Any]:
    meta = {
        "turns": [turn.to_record() for turn in trajectory.turns],
        "num_turns": len(trajectory.turns),
        "round_number": len(trajectory.turns),  # what slime's --log-multi-turn reads
        "stop_reason": str(trajectory.stop_reason),
        "turns_cut": sum(turn.cut_at_cap for turn in trajectory.turns),  # by turnstile.max_new_tokens
    }
    for key in ("start_rollout_id", "num_restarts", "retries"):
        if key in trajectory.metadata:
            meta[key] = trajectory.metadata[key]
    if trajectory.errors:
        meta["errors"] = [f"{e.stage}/{e.error_class}: {e.message}" for e in trajectory.errors]
    if trajectory.status is TrajectoryStatus.FAILED:
        meta["failure"] = trajectory.errors[-1].message if trajectory.errors else str(trajectory.stop_reason)
    return meta
