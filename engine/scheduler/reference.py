"""The sequential reference: one trajectory run to its end, turn after turn, with one slot each and no retries.

    await run_trajectory(trajectory, backend=b, env=runner, encoder=e, sampling=s, limits=TurnLimits(max_turns=4))

It is the scheduler's own loop (`Scheduler.drive`) on a scheduler of its own, so the two cannot disagree.
"""

from __future__ import annotations

from engine.backends.base import Backend, SamplingParams
from engine.encoding import ChatEncoder
from engine.envs.base import EnvRunner
from engine.scheduler.retry import CircuitBreaker, RetryPolicy
from engine.scheduler.scheduler import Scheduler
from engine.trajectory import Trajectory
from engine.turn import TurnLimits


async def run_trajectory(
    trajectory: Trajectory,
    *,
    backend: Backend,
    env: EnvRunner,
    encoder: ChatEncoder,
    sampling: SamplingParams,
    limits: TurnLimits,
) -> Trajectory:
    """Run one trajectory to its end, with no one else in flight; it always ends in exactly one terminal status:
    a failure ends it FAILED with the error recorded, an abort or a cancellation ABORTED."""
    scheduler = Scheduler(
        backend=backend, encoder=encoder, sampling=sampling, limits=limits,
        retry=RetryPolicy(per_turn={}, per_trajectory=0, env_step_timeout_s=None), breaker=CircuitBreaker(),
        max_generating=1, max_env_steps=1, end_on_abort=True,
    )  # fmt: skip
    await scheduler.drive(trajectory, lambda: env)
    return trajectory
