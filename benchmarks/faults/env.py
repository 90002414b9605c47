"""The long-tail workload's env and reward by module path, for processes that build envs from slime-style `args`
(the rollout service in a Ray actor, `engine.envs.faults.build_env`):

    rollout_interaction_env_path: benchmarks.faults.env      # args.fault_workload: Workload's fields
    custom_rm_path: benchmarks.faults.env.reward             # 0.0 where the env gave no reward (cut by a budget)

The env of a sample is the workload's (benchmarks/longtail/workload.py), keyed on its `metadata` (`prompt_id`,
`solve_rate`), as `Workload.build_env` does.
"""

from __future__ import annotations

from typing import Any

from benchmarks.longtail.workload import LongTailEnv, Workload

ARGS_KEY = "fault_workload"


def workload_of(args: Any) -> Workload:
    fields = getattr(args, ARGS_KEY, None) if args is not None else None
    if fields is None:
        raise ValueError(f"benchmarks.faults.env needs args.{ARGS_KEY}: the Workload's fields")
    return Workload(**fields)


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> LongTailEnv:
    return workload_of(args).build_env(sample)


async def reward(args: Any, sample: Any) -> float:
    """slime's custom reward function: a sample the env gave no reward (a budget cut it short) is not solved."""
    return 0.0 if sample.reward is None else sample.reward
