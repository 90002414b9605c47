"""Nothing is lost, proven over random workloads: random failures, aborts, pauses and resumes.

Every admitted prompt ends in exactly one returned group or is still held (finished and waiting to be
returned, or paused); every trajectory ends in exactly one status or waits PAUSED; the token / mask /
log-prob invariant holds; retries stay within their budgets; and with a deterministic backend every
trajectory has the tokens the sequential reference loop gives it.
"""

from __future__ import annotations

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import EnvRunner
from engine.errors import BackendError, EnvRetryableError, ErrorClass
from engine.scheduler.queue import Policy
from engine.scheduler.reference import run_trajectory
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits
from tests.fakes import DeterministicBackend
from tests.test_engine import TurnsEnv

BACKEND_ERRORS = [ErrorClass.SERVER, ErrorClass.CONNECTION, ErrorClass.TIMEOUT, ErrorClass.CLIENT]


@st.composite
def workloads(draw):
    n_prompts = draw(st.integers(1, 5))
    return {
        "turns": draw(st.lists(st.integers(1, 4), min_size=n_prompts, max_size=n_prompts)),
        "n_samples": draw(st.integers(1, 3)),
        "policy": draw(st.sampled_from(list(Policy))),
        "max_generating": draw(st.integers(1, 4)),
        "max_env_steps": draw(st.integers(1, 3)),
        "partial": draw(st.sampled_from([True, True, False])),
        "over_sampling": draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
        "max_staleness": draw(st.sampled_from([0, 0, 1, 2])),
        "on_stale": draw(st.sampled_from(["restart", "finish"])),
        "mask_offpolicy": draw(st.booleans()),
        "stop_every": draw(st.sampled_from([3, 8, 25, 40])),
        "budget": draw(st.integers(0, 2)),
        "total_budget": draw(st.integers(0, 4)),
        "backend_failures": draw(st.dictionaries(st.integers(1, 30), st.sampled_from(BACKEND_ERRORS), max_size=8)),
        "env_failures": draw(
            st.dictionaries(
                st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(1, 4)), st.booleans(), max_size=4
            )
        ),
        "steps": draw(st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=2, max_size=5)),
    }


def rows(turns: list[int]) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"task {i}"}], "metadata": {"turns": t}} for i, t in enumerate(turns)
    ]


async def reference(encoder, row, index: int, stop_every: int) -> list[int]:
    trajectory = Trajectory(prompt=row["prompt"])
    await run_trajectory(
        trajectory,
        backend=DeterministicBackend(stop_every=stop_every),
        env=EnvRunner(TurnsEnv(row["metadata"]["turns"], reward=float(index))),
        encoder=encoder,
        sampling=SamplingParams(max_new_tokens=16, stop_token_ids=encoder.stop_token_ids),
        limits=TurnLimits(max_turns=5, max_tokens=4096),
    )
    return trajectory.tokens.tolist()


async def run_workload(encoder: ChatEncoder, w: dict) -> None:
    failures = {n: BackendError(cls, f"injected {cls}") for n, cls in w["backend_failures"].items()}
    backend = DeterministicBackend(stop_every=w["stop_every"], failures=failures)
    budgets = {cls: w["budget"] for cls in ErrorClass}
    retry = RetryPolicy(per_turn=budgets, per_trajectory=w["total_budget"], backoff_base_s=0.0)

    def build(sample):
        env_failures = {
            attempt: EnvRetryableError("busy") if retryable else RuntimeError("crashed")
            for (group, index, attempt), retryable in w["env_failures"].items()
            if (group, index) == (sample.group_index, sample.index)
        }
        return EnvRunner(TurnsEnv(sample.metadata["turns"], reward=float(sample.index), failures=env_failures))

    config = EngineConfig(
        n_samples_per_prompt=w["n_samples"], max_generating=w["max_generating"], max_env_steps=w["max_env_steps"],
        policy=w["policy"], partial_rollout=w["partial"], over_sampling=w["over_sampling"],
        max_staleness=w["max_staleness"], on_stale=w["on_stale"], mask_offpolicy=w["mask_offpolicy"], retry=retry,
        limits=TurnLimits(max_turns=5, max_tokens=4096), sampling=SamplingParams(max_new_tokens=16),
        breaker_min_attempts=10_000, max_failed_share=1.0,
    )  # fmt: skip
    prompts = rows(w["turns"])
    returned = []
    async with RolloutEngine(
        backend=backend, encoder=encoder, env_factory=build, source=prompts, config=config
    ) as engine:
        for version, (target, update) in enumerate(w["steps"], start=1):
            returned += await engine.rollout(target)
            if update:
                await engine.pause()
                backend.version = f"v{version}"
                await engine.resume(f"v{version}")
        if w["partial"]:  # hold what is left: pause (the last step may have resumed) and let env steps finish
            await engine.pause()
            await engine.wait_until_parked()
        stats = engine.statistics()
        held_open = engine.open_groups
        held_done = [g for g in engine.held_groups if g.is_done]

        # every admitted prompt: exactly one of returned, finished-and-held, or open (paused)
        ids = [g.group_id for g in returned] + [g.group_id for g in held_done] + [g.group_id for g in held_open]
        assert sorted(ids) == list(range(stats.num_prompts_admitted))
        assert stats.num_groups_dropped == {}
        for group in held_open:
            for t in group.trajectories:
                assert t.status.is_terminal or t.status is Status.PAUSED or not w["partial"]
        assert backend.running == {}  # nothing generates while the step is returned (or after a barrier)

    for group in returned + held_done:
        assert len(group.trajectories) == w["n_samples"]
        for t in group.trajectories:
            assert t.status.is_terminal and t.stop_reason is not None
            t.check_invariant()
            retries = t.metadata.get("retries", {})
            assert sum(retries.values()) <= w["total_budget"]
            assert all(turn.retries <= w["budget"] * len(ErrorClass) for turn in t.turns)
            if t.status is Status.FAILED:
                message = t.errors[-1].message if t.errors else ""
                assert "retry budget spent" in message or "not retried: env TurnsEnv is not replay_safe" in message
                continue
            expected = await reference(encoder, group.row, t.index, w["stop_every"])
            if t.stop_reason in (StopReason.ABORTED, StopReason.STALE):  # cut short: a prefix of the reference
                assert expected[: len(t.tokens)] == t.tokens.tolist()
            else:
                assert t.tokens.tolist() == expected


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=workloads())
def test_nothing_is_lost_over_random_workloads(encoder, w):
    anyio.run(run_workload, encoder, w)
