"""Nothing is lost under faults, over random interleavings: env failures (exceptions, retryable errors, hangs
past the step timeout, malformed returns, observations and contents, from engine.envs.faults), server
failures (5xx, connection errors, timeouts, malformed replies, requests aborted by the server), and steps,
pauses, resumes and aborts of every request on the backend, some of them in the middle of a step.

After every step and every pause the engine is checked: each trajectory of each group returned or held has
exactly one status (terminal, with a stop reason) or waits PAUSED (while generation is paused, once parked),
or runs (while it is not); its tokens, loss mask and log-probs are aligned (`check_invariant`); every group
is whole; and every admitted prompt is in exactly one place: returned once, or held.
"""

from __future__ import annotations

import functools

import anyio
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.backends.base import GenerateResult, SamplingParams
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import AsyncInteractionEnv, BaseInteractionEnv, EnvRunner
from engine.envs.faults import FaultLog, FaultSpec, inject, release_hangs
from engine.errors import BackendError, ErrorClass
from engine.scheduler.queue import Policy
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Group, Status
from engine.turn import TurnLimits
from tests.fakes import DeterministicBackend

STEP_TIMEOUT_S = 0.05
HANG_S = 0.15  # past the step timeout; a sync hang's thread returns after it
PARK_TIMEOUT_S = 20.0  # a pause that does not park every trajectory within this is a hang of the engine
BACKEND_ERRORS = [ErrorClass.SERVER, ErrorClass.CONNECTION, ErrorClass.TIMEOUT, ErrorClass.MALFORMED]
RATES = [0.0, 0.0, 0.05, 0.15]  # six kinds: at most 0.85 in all


class StepsEnv(BaseInteractionEnv):
    def __init__(self, turns: int, replay_safe: bool):
        self.turns, self.replay_safe, self.done_steps = turns, replay_safe, 0

    def reset(self):
        self.done_steps = 0
        return {}, {}

    def step(self, response_text):
        self.done_steps += 1
        done = self.done_steps >= self.turns
        return {"obs_str": f"observation {self.done_steps}"}, done, {"reward": float(self.done_steps)} if done else {}


class AsyncStepsEnv(AsyncInteractionEnv, StepsEnv):
    async def astep(self, response_text):
        return StepsEnv.step(self, response_text)


class FaultyBackend(DeterministicBackend):
    """DeterministicBackend whose call numbers in `server_aborts` come back aborted by the server, at once;
    `after(k)` is an event set when the k-th generate call from now is made."""

    def __init__(self, *, server_aborts: set[int], **kw):
        super().__init__(**kw)
        self.server_aborts = server_aborts
        self._triggers: list[tuple[int, anyio.Event]] = []

    def after(self, k: int) -> anyio.Event:
        reached = anyio.Event()
        self._triggers.append((self.num_calls + k, reached))
        return reached

    async def generate(self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None):
        call = self.num_calls + 1
        for at, reached in self._triggers:
            if call >= at:
                reached.set()
        if call in self.server_aborts:
            self.num_calls = call
            await anyio.lowlevel.checkpoint()
            return GenerateResult([], [], "", "abort", self.version, prompt_tokens=len(input_ids))
        return await super().generate(input_ids, sampling_params, image_data, rid=rid, session_id=session_id)


STEP = st.one_of(
    st.tuples(st.just("rollout"), st.integers(1, 3)),
    st.tuples(st.just("update"), st.booleans()),  # pause, maybe a new weight version, resume
    st.tuples(st.just("pause_mid_step"), st.integers(1, 12)),  # during a rollout, after k more generate calls
    st.tuples(st.just("abort_mid_step"), st.integers(1, 12)),  # the backend aborts every request, unpaused
)


@st.composite
def scenarios(draw):
    n_prompts = draw(st.integers(1, 6))
    return {
        "turns": draw(st.lists(st.integers(1, 3), min_size=n_prompts, max_size=n_prompts)),
        "n_samples": draw(st.integers(1, 3)),
        "policy": draw(st.sampled_from(list(Policy))),
        "max_generating": draw(st.integers(1, 4)),
        "max_env_steps": draw(st.integers(1, 3)),
        "partial": draw(st.sampled_from([True, True, False])),
        "over_sampling": draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
        "budget": draw(st.integers(0, 2)),
        "total_budget": draw(st.integers(0, 4)),
        "faults": {
            kind: draw(st.sampled_from(RATES))
            for kind in ("exception", "retryable", "malformed_return", "malformed_observation", "malformed_content")
        }
        | {"hang": draw(st.sampled_from([0.0, 0.0, 0.1]))},
        "on_reset": draw(st.booleans()),
        "replay_safe": draw(st.booleans()),
        "asynchronous": draw(st.booleans()),
        "seed": draw(st.integers(0, 1000)),
        "backend_failures": draw(st.dictionaries(st.integers(1, 40), st.sampled_from(BACKEND_ERRORS), max_size=6)),
        "server_aborts": draw(st.sets(st.integers(1, 40), max_size=3)),
        "steps": draw(st.lists(STEP, min_size=2, max_size=6)),
    }


def rows(turns: list[int]) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"task {i}"}], "metadata": {"turns": t}} for i, t in enumerate(turns)
    ]


class Ledger:
    """What came back from the engine, and the checks after each step."""

    def __init__(self, n_samples: int):
        self.n_samples = n_samples
        self.returned: list[Group] = []

    def take(self, groups: list[Group]) -> None:
        self.returned += groups

    def check(self, engine: RolloutEngine, *, parked: bool, in_step: bool = False) -> None:
        """`in_step`: a rollout call is under way (the groups it is about to return are in neither place)."""
        stats = engine.statistics()
        held = engine.held_groups
        ids = [g.group_id for g in self.returned] + [g.group_id for g in held]
        assert len(ids) == len(set(ids)), "a prompt returned twice, or returned and held"
        if in_step:
            assert set(ids) <= set(range(stats.num_prompts_admitted))
        else:
            assert sorted(ids) == list(range(stats.num_prompts_admitted)), "a prompt lost"
        assert stats.num_groups_dropped == {}
        for group in self.returned:
            assert group.is_done
        for group in [*self.returned, *held]:
            assert len(group.trajectories) == self.n_samples
            for t in group.trajectories:
                t.check_invariant()
                if t.status.is_terminal:
                    assert t.stop_reason is not None
                    assert t.status is not Status.FAILED or t.errors
                elif parked:
                    assert t.status is Status.PAUSED, (t.status, t.stop_reason)
                else:
                    assert t.status in (Status.PENDING, Status.RUNNING, Status.PAUSED)


async def run_scenario(encoder: ChatEncoder, s: dict) -> None:
    failures = {n: BackendError(cls, f"injected {cls}") for n, cls in s["backend_failures"].items()}
    backend = FaultyBackend(stop_every=5, failures=failures, server_aborts=set(s["server_aborts"]))
    spec = FaultSpec(**s["faults"], hang_s=HANG_S, on_reset=s["on_reset"], seed=s["seed"])
    log = FaultLog()

    def build(sample):
        env = (AsyncStepsEnv if s["asynchronous"] else StepsEnv)(sample.metadata["turns"], s["replay_safe"])
        return EnvRunner(inject(env, spec, key=(sample.group_index, sample.index), log=log))

    retry = RetryPolicy(
        per_turn={cls: s["budget"] for cls in ErrorClass}, per_trajectory=s["total_budget"], backoff_base_s=0.0,
        env_step_timeout_s=STEP_TIMEOUT_S, reward_timeout_s=5.0,
    )  # fmt: skip
    config = EngineConfig(
        n_samples_per_prompt=s["n_samples"], max_generating=s["max_generating"], max_env_steps=s["max_env_steps"],
        policy=s["policy"], partial_rollout=s["partial"], over_sampling=s["over_sampling"], retry=retry,
        limits=TurnLimits(max_turns=4, max_tokens=4096), sampling=SamplingParams(max_new_tokens=12),
        breaker_min_attempts=10_000,
    )  # fmt: skip
    ledger = Ledger(s["n_samples"])
    version = 0
    async with RolloutEngine(
        backend=backend, encoder=encoder, env_factory=build, source=rows(s["turns"]), config=config
    ) as engine:

        async def rollout(target: int) -> None:
            try:
                groups = await engine.rollout(target)
            except Exception as exc:  # a step refused for its failures hands its groups back on the error
                groups = getattr(exc, "groups", None)
                if not isinstance(groups, list):
                    raise
            ledger.take(groups)

        async def pause_and_check(in_step: bool = False) -> None:
            await engine.pause()
            with anyio.fail_after(PARK_TIMEOUT_S):
                await engine.wait_until_parked()
            ledger.check(engine, parked=True, in_step=in_step)

        async def after_calls(k: int, action) -> None:
            await backend.after(k).wait()
            await action()

        for kind, arg in s["steps"]:
            if kind == "rollout":
                await rollout(arg)
            elif kind == "update":
                await pause_and_check()
                if arg:
                    version += 1
                    backend.version = f"v{version}"
                await engine.resume(backend.version)
            else:

                async def mid_step(kind=kind) -> None:
                    event(kind)
                    if kind == "pause_mid_step":
                        await pause_and_check(in_step=True)
                        await engine.resume(backend.version)
                    else:
                        await backend.abort()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(after_calls, arg, mid_step)
                    await rollout(1)
                    tg.cancel_scope.cancel()
            ledger.check(engine, parked=False)
        if s["partial"]:
            await pause_and_check()
        held = engine.held_groups
        if any(not t.is_ended for g in held for t in g.trajectories):
            event("trajectories held paused at the end")
    for group in [*ledger.returned, *held]:  # after the engine: every trajectory ended, held ones ABORTED at most
        for t in group.trajectories:
            assert t.status.is_terminal
            t.check_invariant()
            event(f"ended {t.status}" + (f" ({t.errors[-1].error_class})" if t.errors else ""))


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=scenarios())
def test_nothing_is_lost_under_random_faults_pauses_and_aborts(encoder, s):
    try:
        anyio.run(functools.partial(run_scenario, encoder, s))
    finally:
        release_hangs()
