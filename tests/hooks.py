"""slime hook functions for the bridge's tests, loaded by path as slime loads them
(`--custom-rm-path tests.hooks.length_rm`, ...). Each records its calls in `CALLS`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CALLS: list[tuple[str, Any]] = []


@dataclass
class FilterOutput:
    """slime's DynamicFilterOutput, by shape (slime is not importable in tests)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def length_reward(sample: Any) -> float:
    """What `length_rm` scores: a function of the sample's response and label only."""
    return float((len(sample.response) + len(str(sample.label))) % 7)


async def length_rm(args: Any, sample: Any) -> float:
    CALLS.append(("length_rm", sample.index))
    return length_reward(sample)


async def dict_rm(args: Any, sample: Any) -> dict[str, float]:
    CALLS.append(("dict_rm", sample.index))
    return {"acc": length_reward(sample), "format": 1.0}


async def rank_group_rm(args: Any, samples: list[Any]) -> list[float]:
    """--group-rm: the whole group at once; each member's rank by response length."""
    CALLS.append(("rank_group_rm", [s.index for s in samples]))
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].response), i))
    return [float(order.index(i)) for i in range(len(samples))]


def keep_odd_groups(args: Any, samples: list[Any]) -> FilterOutput:
    CALLS.append(("keep_odd_groups", samples[0].group_index))
    keep = samples[0].group_index % 2 == 1
    return FilterOutput(keep=keep, reason=None if keep else "even_group")


def mark_sample(args: Any, sample: Any, rollout_id: int | None = None, evaluation: bool = False) -> None:
    """A rollout sample hook: notes what it was called with; gives sample index 0 a reward of its own."""
    CALLS.append(("mark_sample", (sample.index, rollout_id, evaluation, sample.reward)))
    sample.metadata["hooked"] = [rollout_id, evaluation]
    if sample.index == 0:
        sample.reward = 5.0


def remove_every_third(args: Any, data: list[list[Any]]) -> None:
    """--rollout-sample-filter-path: slime's signature (args, data); marks samples not to train."""
    CALLS.append(("remove_every_third", [g[0].group_index for g in data]))
    for group in data:
        for sample in group:
            if sample.index % 3 == 0:
                sample.remove_sample = True


def see_all_samples(args: Any, all_samples: list[list[Any]], data_source: Any) -> None:
    CALLS.append(("see_all_samples", ([g[0].group_index for g in all_samples], data_source)))


def drop_group_one(args: Any, samples: list[Any]) -> FilterOutput:
    """A dynamic sampling filter that drops exactly one known prompt (group_index 1)."""
    CALLS.append(("drop_group_one", samples[0].group_index))
    keep = samples[0].group_index != 1
    return FilterOutput(keep=keep, reason=None if keep else "group_one")


def break_first_sample(args: Any, sample: Any) -> None:
    """A rollout sample hook that raises on member 0 of each group (a bug in a user's hook)."""
    CALLS.append(("break_first_sample", sample.index))
    if sample.index % 2 == 0:
        raise ValueError("hook bug")
