"""The slime-style baseline: how slime's multi-turn example rolls out (see SLIME_CONTRACT.md).

Per rollout step, `target_groups * n_samples` trajectories, one coroutine each; each holds a slot of
one concurrency semaphore for its whole life, env steps included (slime's `generate_and_rm` holds
its semaphore around the custom generate function). The turn loop calls the backend, then calls the
env's synchronous `step` inside the event loop, blocking it as slime's example does, so while one
env step runs no other trajectory moves. A barrier (gather) ends each step; there is no partial
rollout (the multi-turn example asserts it off).

Rewards as slime's `generate_and_rm` computes them: once a trajectory's generation is over and its
semaphore slot released, the sample is scored (when it has no reward yet and is not ABORTED) by
awaiting the reward function, and its group (`generate_and_rm_group`'s gather) is done only once
every member has been scored. With `reward_latency_s` 0 the rule runs at once, as slime's rule-based
`async_rm` does without yielding.

Two things are more generous than slime at HEAD: an env exception fails only its trajectory (slime
would lose the whole step), and the response text is decoded on the client as Turnstile does.
Tokens, turns and metrics go through the same `Trajectory`, `ChatEncoder` and `generate_turn`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.longtail.common import PolicyRun, RewardModel, Setup, TimedEnv
from engine.envs.base import StepResult
from engine.errors import EnvError, ErrorClass, TurnError
from engine.scheduler.scheduler import maybe_await
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import (
    encode_prompt,
    end_of_turn,
    generate_turn,
    observe,
    out_of_room,
    record_failure,
    stop_after_generation,
)


async def run_slime_style(setup: Setup) -> PolicyRun:
    run = PolicyRun("slime_style", started=time.monotonic())
    semaphore = asyncio.Semaphore(setup.concurrency)
    reward = setup.reward_model()
    rows = setup.rows()
    for step in range(setup.num_steps):
        started = time.monotonic()
        batch = [(step * setup.target_groups + g, next(rows)) for g in range(setup.target_groups)]
        groups = await asyncio.gather(*(_group(setup, semaphore, reward, g, row, run) for g, row in batch))  # barrier
        run.step_times.append((started, time.monotonic()))
        run.returned.append([t for group in groups for t in group])
        run.trainer_versions.append(await setup.backend.weight_version())
        await setup.backend.update_weights_from_disk("/sim/weights", weight_version=f"v{step + 1}")
    run.wall_seconds = time.monotonic() - run.started
    run.server = await setup.server_stats()
    return run


async def _group(
    setup: Setup,
    semaphore: asyncio.Semaphore,
    reward: RewardModel | None,
    group_id: int,
    row: dict[str, Any],
    run: PolicyRun,
) -> list[Trajectory]:
    """slime's generate_and_rm_group: every member generated and scored, then the group is done."""
    members = (_trajectory(setup, semaphore, reward, group_id, i, row, run) for i in range(setup.n_samples))
    return list(await asyncio.gather(*members))


async def _trajectory(
    setup: Setup,
    semaphore: asyncio.Semaphore,
    reward: RewardModel | None,
    group_id: int,
    index: int,
    row: dict[str, Any],
    run: PolicyRun,
) -> Trajectory:
    """slime's generate_and_rm: generation under the semaphore, then the reward, outside it."""
    trajectory = Trajectory(prompt=row["prompt"], group_id=group_id, index=index, metadata=dict(row["metadata"]))
    run.submitted[trajectory.id] = time.monotonic()
    async with semaphore:  # held for the whole trajectory, env steps included
        env = setup.make_env(row)
        stop: StopReason | None = None
        try:
            await encode_prompt(trajectory, setup.encoder)
            trajectory.transition(Status.RUNNING)
            env.reset()
            stop = out_of_room(trajectory, setup.limits)
            while stop is None:
                result = await generate_turn(trajectory, setup.backend, setup.sampling, setup.limits)
                stop = stop_after_generation(trajectory, result, setup.limits)
                if stop is None:
                    stop = await _env_turn_blocking(setup, trajectory, env)
        except TurnError as exc:
            stop = record_failure(trajectory, exc)
        except Exception as exc:  # the env raised: this trajectory fails (slime at HEAD loses the step)
            stop = record_failure(trajectory, EnvError(ErrorClass.ENV_EXCEPTION, f"env step raised {exc!r}"))
        finally:
            env.close()
            trajectory.finish(stop or StopReason.ABORTED)
    setup.rewards.ended[trajectory.id] = time.monotonic()
    if reward is not None and trajectory.reward is None and trajectory.status is not Status.ABORTED:
        trajectory.reward = await maybe_await(reward(trajectory))
    setup.rewards.note_settled(trajectory)
    return trajectory


async def _env_turn_blocking(setup: Setup, trajectory: Trajectory, env: TimedEnv) -> StopReason | None:
    """engine.turn's steps 4 and 5, with the env's `step` called right here, in the event loop."""
    turn = trajectory.turns[-1]
    generated = trajectory.generated_ids(turn).tolist()
    started = time.monotonic()
    observation, done, info = env.step(setup.encoder.response_text(generated))  # blocks every coroutine
    turn.env_seconds = time.monotonic() - started
    stop = end_of_turn(trajectory, StepResult(observation or {}, bool(done), info or {}), setup.limits)
    if stop is None:
        stop = await observe(trajectory, env.format_observation(observation), setup.encoder, setup.limits)
    return stop
