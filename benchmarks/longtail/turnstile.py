"""The two Turnstile policies: turn-level scheduling, without and with partial rollout.

Both drive the same `RolloutEngine` (engine/engine.py) with generation slots equal to the baseline's
concurrency, the size's priority policy and the env's blocking `step` in worker threads (the
engine's EnvRunner). With partial rollout a step keeps `target * over_sampling` groups in flight,
returns once `target` are done (starting up to `target * refill` more in its tail, while fewer
trajectories are live than the server's slots), and keeps the rest paused, envs and all, for the
next step; trajectories more than `max_staleness` weight versions stale when they resume start
again. With the reward from a reward function, it is the engine's `reward_fn`: each trajectory is
scored as it ends, while the others generate, and its group is done once its last member is scored.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

from benchmarks.longtail.common import PolicyRun, SettledObserver, Setup
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import EnvRunner
from engine.envs.loader import EnvSample

ENV_STEP_TIMEOUT_S = 60.0


def engine_config(setup: Setup, *, partial: bool) -> EngineConfig:
    over_sampling = setup.over_sampling if partial else 1.0
    return EngineConfig(
        n_samples_per_prompt=setup.n_samples,
        max_inflight=math.ceil(setup.target_groups * over_sampling) * setup.n_samples,
        max_generating=setup.concurrency,
        max_env_steps=setup.max_env_steps,
        policy=setup.scheduling,
        partial_rollout=partial,
        over_sampling=over_sampling,
        in_flight="fixed",  # the workload's in-flight size, as slime's over-sampling sets it
        refill=setup.refill,
        max_staleness=setup.max_staleness,
        on_stale="restart",
        limits=setup.limits,
        sampling=setup.sampling,
        seed=setup.workload.seed,
        gc_freeze=setup.gc_freeze,
    )


async def run_turnstile(setup: Setup, *, partial: bool) -> PolicyRun:
    run = PolicyRun("turn_partial" if partial else "turn", started=time.monotonic())

    def env_factory(sample: EnvSample) -> EnvRunner:
        return EnvRunner(setup.make_env(sample), step_timeout=ENV_STEP_TIMEOUT_S)

    engine = RolloutEngine(
        backend=setup.backend,
        encoder=setup.encoder,
        env_factory=env_factory,
        source=setup.rows(),
        config=engine_config(setup, partial=partial),
        reward_fn=setup.reward_model(),  # None when the env reports the reward
        observers=[SettledObserver(setup.rewards)],
    )
    async with engine:
        for step in range(setup.num_steps):
            started = time.monotonic()
            groups = await engine.rollout(setup.target_groups)
            run.step_times.append((started, time.monotonic()))
            run.returned.append([t for group in groups for t in group.trajectories])
            run.trainer_versions.append(await setup.backend.weight_version())
            await engine.pause()
            await setup.backend.update_weights_from_disk("/sim/weights", weight_version=f"v{step + 1}")
            if step + 1 < setup.num_steps:
                await engine.resume(f"v{step + 1}")
        run.wall_seconds = time.monotonic() - run.started
        run.server = await setup.server_stats()
        run.unfinished = [t for group in engine.held_groups for t in group.trajectories]
        run.engine = _statistics(engine)
    return run


def _statistics(engine: RolloutEngine) -> dict[str, Any]:
    stats = engine.statistics()
    scheduler = stats.scheduler
    return {
        "num_prompts_admitted": stats.num_prompts_admitted,
        "num_groups_returned": stats.num_groups_returned,
        "num_groups_held": stats.num_groups_open + stats.num_groups_done,
        "retries": {str(k): v for k, v in scheduler.retries.items()},
        "budgets_exhausted": {str(k): v for k, v in scheduler.budgets_exhausted.items()},
        "num_paused": scheduler.num_paused,
        "num_restarted": scheduler.num_restarted,
        "num_discarded_tokens_by_restart": scheduler.num_discarded_tokens,
        "breaker": asdict(scheduler.breaker),
    }
