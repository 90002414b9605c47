"""slime's own logging hooks, pointed here by the loop (`--custom-rollout-log-function-path`,
`--custom-eval-rollout-log-function-path`): each records what slime hands it to the run's JSON-lines file
(`args.loop_metrics_path`) and returns False, so slime's own logging runs after it as usual.

Per train step: the reward, each sample's status and, for every model token, the weight version that
generated it (from the turn records the bridge puts in `metadata["turns"]`); the report sets these against
the version the trainer trained with. Per eval: the mean reward of each eval dataset.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any


def _flat(samples: Any) -> list[Any]:
    return [s for item in samples for s in (item if isinstance(item, list) else [item])]


def _write(args: Any, row: dict[str, Any]) -> None:
    with open(args.loop_metrics_path, "a") as f:
        f.write(json.dumps({"time": time.time(), **row}) + "\n")


def token_versions(sample: Any) -> Counter[str]:
    """Model tokens of `sample` by the weight version that generated them."""
    counts: Counter[str] = Counter()
    for turn in (sample.metadata or {}).get("turns", []):
        counts[str(turn.get("weight_version"))] += int(turn.get("num_generated", 0))
    return counts


def log_rollout(rollout_id: int, args: Any, samples: Any, extra_metrics: Any, rollout_time: float) -> bool:
    flat = _flat(samples)
    versions: Counter[str] = Counter()
    for sample in flat:
        if not getattr(sample, "remove_sample", False):
            versions += token_versions(sample)
    rewards = [s.reward for s in flat if isinstance(s.reward, int | float)]
    _write(
        args,
        {
            "source": "rollout",
            "rollout_id": rollout_id,
            "samples": len(flat),
            "reward": sum(rewards) / len(rewards) if rewards else None,
            "statuses": dict(Counter(str(getattr(s.status, "value", s.status)) for s in flat)),
            "removed": sum(bool(getattr(s, "remove_sample", False)) for s in flat),
            "token_versions": dict(versions),
            "rollout_time": rollout_time,
        },
    )
    return False


def log_eval(rollout_id: int, args: Any, data: dict[str, Any], extra_metrics: Any) -> bool:
    rewards = {name: sum(d["rewards"]) / len(d["rewards"]) for name, d in data.items() if d.get("rewards")}
    _write(args, {"source": "eval", "rollout_id": rollout_id, "reward": rewards})
    return False
