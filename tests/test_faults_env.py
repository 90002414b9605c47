"""engine.envs.faults: faults drawn at their rates, the same for the same seed and env; each kind surfacing
in the engine as its error class; the wrapper loaded from a config; an env in a child process that dies;
a reward function that fails."""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from types import SimpleNamespace

import anyio
import pytest

from benchmarks.longtail.workload import Workload
from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.arith import make_prompts
from engine.envs.base import AsyncInteractionEnv, BaseInteractionEnv, EnvRunner
from engine.envs.faults import (
    ENV_VARIABLE,
    EXPECTED_ERROR,
    AsyncFaultyEnv,
    EnvProcessDied,
    FaultInjected,
    FaultKind,
    FaultLog,
    FaultSpec,
    FaultyEnv,
    FaultyReward,
    RewardFault,
    SubprocessEnv,
    inject,
)
from engine.envs.loader import EnvFactory, EnvLoadError, EnvSample
from engine.errors import EnvError, EnvRetryableError, ErrorClass
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status
from engine.turn import TurnLimits
from tests.fakes import DeterministicBackend

STEP_TIMEOUT_S = 0.05
HANG_S = 0.3  # a sync hang's thread returns after this; the engine gave up on it at STEP_TIMEOUT_S


class StepsEnv(BaseInteractionEnv):
    """Done after `turns` steps; counts its resets and steps."""

    def __init__(self, turns: int = 3, replay_safe: bool = False):
        self.turns, self.replay_safe = turns, replay_safe
        self.resets = self.steps = self.done_steps = 0
        self.closed = False

    def reset(self):
        self.resets += 1
        self.done_steps = 0
        return {}, {}

    def step(self, response_text):
        self.steps += 1
        self.done_steps += 1
        done = self.done_steps >= self.turns
        return {"obs_str": f"observation {self.done_steps}"}, done, {"reward": 1.0} if done else {}

    def close(self):
        self.closed = True


class AsyncStepsEnv(AsyncInteractionEnv, StepsEnv):
    async def astep(self, response_text):
        return StepsEnv.step(self, response_text)


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def only(kind: FaultKind, **extra) -> FaultSpec:
    return FaultSpec(**{str(kind): 1.0}, hang_s=HANG_S, **extra)


async def run_engine(encoder, build, *, prompts: int = 1, n: int = 1, reward_fn=None, retry: RetryPolicy | None = None):
    """Every prompt to its end through a RolloutEngine; the trajectories, in group then member order."""
    config = EngineConfig(
        n_samples_per_prompt=n, max_generating=4, max_env_steps=4,
        retry=retry or RetryPolicy(backoff_base_s=0.0, env_step_timeout_s=STEP_TIMEOUT_S),
        limits=TurnLimits(max_turns=6, max_tokens=4096), sampling=SamplingParams(max_new_tokens=16),
        breaker_min_attempts=10_000,
    )  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": f"task {i}"}], "metadata": {"i": i}} for i in range(prompts)]
    async with RolloutEngine(
        backend=DeterministicBackend(stop_every=4), encoder=encoder, env_factory=build, source=rows, config=config,
        reward_fn=reward_fn,
    ) as engine:  # fmt: skip
        groups = [group async for group in engine.stream()]
    return [t for g in sorted(groups, key=lambda g: g.group_id) for t in g.trajectories]


# -- the draws --------------------------------------------------------------------------------------------


def test_rates_are_honoured_and_the_draws_are_the_same_for_the_same_seed_and_env():
    spec = FaultSpec(exception=0.1, retryable=0.05, hang=0.05, malformed_return=0.04, malformed_observation=0.03,
                     malformed_content=0.02, seed=3)  # fmt: skip
    draws = [spec.draw(f"env-{k}", "step", n) for k in range(400) for n in range(50)]
    total = len(draws)
    for kind in FaultKind:
        rate = spec.rate(kind)
        count = sum(d is kind for d in draws)
        sigma = math.sqrt(total * rate * (1 - rate))
        assert abs(count - total * rate) < 4 * sigma, (kind, count, total * rate)
    assert draws == [spec.draw(f"env-{k}", "step", n) for k in range(400) for n in range(50)]
    other_seed = spec.model_copy(update={"seed": 4})
    assert draws != [other_seed.draw(f"env-{k}", "step", n) for k in range(400) for n in range(50)]
    other_env = [spec.draw(f"env-{k + 1}", "step", n) for k in range(400) for n in range(50)]
    assert draws[:50] != other_env[:50] or draws[50:100] != other_env[50:100]
    assert spec.draw("env-0", "reset", 0) is None  # resets draw only with on_reset


def test_rates_adding_up_past_one_are_refused():
    with pytest.raises(ValueError, match="add up"):
        FaultSpec(exception=0.6, hang=0.5)


def test_the_wrapper_faults_exactly_the_calls_the_spec_draws_and_leaves_the_env_untouched_by_them():
    spec = FaultSpec(exception=0.2, retryable=0.1, malformed_return=0.1, seed=1)
    inner = StepsEnv(turns=10_000)
    env = FaultyEnv(inner, spec, key="k")
    seen = []
    for _n in range(300):
        try:
            result = env.step("text")
        except FaultInjected:
            seen.append(FaultKind.EXCEPTION)
        except EnvRetryableError:
            seen.append(FaultKind.RETRYABLE)
        else:
            seen.append(FaultKind.MALFORMED_RETURN if not (isinstance(result, tuple) and len(result) == 3) else None)
    assert seen == [spec.draw("k", "step", n) for n in range(300)]
    assert inner.steps == seen.count(None)  # a faulted call never reached the env
    assert sum(env.injected.values()) == 300 - seen.count(None)


def test_an_env_built_again_with_the_same_key_goes_on_counting_in_a_shared_log():
    spec = FaultSpec(exception=0.5, seed=2)
    log = FaultLog()
    first = FaultyEnv(StepsEnv(), spec, key="same", log=log)
    for _ in range(3):
        with contextlib.suppress(FaultInjected):
            first.step("x")
    again = FaultyEnv(StepsEnv(), spec, key="same", log=log)
    outcomes = []
    for _n in range(3, 10):
        try:
            again.step("x")
            outcomes.append(None)
        except FaultInjected:
            outcomes.append(FaultKind.EXCEPTION)
    assert outcomes == [spec.draw("same", "step", n) for n in range(3, 10)]
    assert log.snapshot()["calls"] == {"step": 10}


# -- each fault, through the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", list(FaultKind), ids=str)
def test_each_fault_surfaces_in_the_engine_as_its_error_class(encoder, kind, asynchronous):
    envs = []

    def build(sample):
        env = inject(AsyncStepsEnv() if asynchronous else StepsEnv(), only(kind), key=sample.group_index)
        envs.append(env)
        return EnvRunner(env)

    trajectories = anyio.run(functools.partial(run_engine, encoder, build, prompts=2))
    assert isinstance(envs[0], AsyncFaultyEnv if asynchronous else FaultyEnv)
    for t in trajectories:
        assert t.status is Status.FAILED, (kind, t.status, t.errors)
        assert t.errors[-1].error_class is EXPECTED_ERROR[kind], (kind, t.errors)
        t.check_invariant()


def test_a_replay_safe_wrapper_lets_the_engine_retry_what_a_plain_env_fails_on(encoder):
    spec = FaultSpec(exception=0.3, seed=5)
    outcomes = {}
    for replay_safe in (False, True):
        log = FaultLog()

        def build(sample, replay_safe=replay_safe, log=log):
            key = f"{sample.group_index}/{sample.index}"
            return EnvRunner(inject(StepsEnv(turns=3), spec.model_copy(update={"replay_safe": replay_safe}),
                                    key=key, log=log))  # fmt: skip

        trajectories = anyio.run(functools.partial(run_engine, encoder, build, prompts=6, n=2))
        outcomes[replay_safe] = trajectories
    # not replay safe: a trajectory fails exactly when one of its first 3 step calls is drawn faulted
    for t in outcomes[False]:
        faulted = any(spec.draw(f"{t.group_id}/{t.index}", "step", n) for n in range(3))
        assert (t.status is Status.FAILED) == faulted, (t.group_id, t.index, t.errors)
    failed_plain = sum(t.status is Status.FAILED for t in outcomes[False])
    failed_safe = sum(t.status is Status.FAILED for t in outcomes[True])
    assert failed_plain > 0
    assert failed_safe < failed_plain
    retried = [t for t in outcomes[True] if t.metadata.get("retries")]
    assert retried and all(set(t.metadata["retries"]) == {"env_exception"} for t in retried)


def test_a_hung_sync_call_returns_once_the_env_is_closed():
    env = FaultyEnv(StepsEnv(), FaultSpec(hang=1.0, hang_s=60.0), key="k")
    raised = []

    def step():
        try:
            env.step("x")
        except FaultInjected as exc:
            raised.append(exc)

    thread = threading.Thread(target=step)
    thread.start()
    env.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and raised


# -- from a config ----------------------------------------------------------------------------------------


def test_build_env_wraps_the_env_a_config_names():
    row = make_prompts(1)[0]
    sample = EnvSample.from_row(row, index=0, group_index=0)
    args = SimpleNamespace(max_turns=4, fault_injection={"env_path": "engine.envs.arith", "exception": 1.0})
    runner = EnvFactory("engine.envs.faults", args=args, step_timeout=1.0)(sample)
    assert isinstance(runner.env, FaultyEnv) and runner.env.env.__class__.__name__ == "ArithEnv"

    async def step(runner):
        await runner.reset()
        return await runner.step(row["label"])

    with pytest.raises(EnvError) as raised:
        anyio.run(step, runner)
    assert raised.value.error_class is ErrorClass.ENV_EXCEPTION and "injected exception" in raised.value.message

    clean = EnvFactory("engine.envs.faults", args=SimpleNamespace(fault_injection={"env_path": "engine.envs.arith"}))
    result = anyio.run(step, clean(sample))
    assert result.done and result.info["reward"] == 1.0  # no faults: the wrapped env answers as itself


def test_build_env_reads_the_environment_variable_when_args_has_no_settings(tmp_path, monkeypatch):
    config = tmp_path / "faults.yaml"
    config.write_text("fault_injection:\n  env_path: engine.envs.arith\n  malformed_return: 1.0\n  seed: 9\n")
    monkeypatch.setenv(ENV_VARIABLE, str(config))
    runner = EnvFactory("engine.envs.faults", args=SimpleNamespace(max_turns=4))(EnvSample(prompt="q", label="1"))
    assert runner.env.spec.malformed_return == 1.0 and runner.env.spec.seed == 9

    monkeypatch.setenv(ENV_VARIABLE, "{env_path: engine.envs.arith, hang: 0.5}")
    runner = EnvFactory("engine.envs.faults")(EnvSample(prompt="q", label="1"))
    assert runner.env.spec.hang == 0.5

    monkeypatch.delenv(ENV_VARIABLE)
    with pytest.raises(EnvLoadError, match="fault_injection"):
        EnvFactory("engine.envs.faults")(EnvSample(prompt="q"))


# -- an env in a child process -----------------------------------------------------------------------------


def workload_env(prompt_id: int = 0) -> functools.partial:
    workload = Workload("t", env_median_s=0.0, failure_rate=0.0)
    return functools.partial(workload.build_env, {"metadata": workload.rows(1, start=prompt_id)[0]["metadata"]})


def test_a_subprocess_env_steps_in_its_child_and_raises_once_the_child_is_killed():
    env = SubprocessEnv(workload_env(), key="child")
    try:
        assert env.reset() == ({}, {})
        observation, done, _ = env.step("first answer")
        assert not done and observation["obs_str"].startswith("$ run_tool")
        pid = env.pid
        assert env in SubprocessEnv.live() and pid is not None
        env.kill()
        with pytest.raises(EnvProcessDied, match=str(pid)):
            env.step("second answer")
        with pytest.raises(EnvProcessDied):
            env.reset()  # not replay safe: it stays dead
        assert env not in SubprocessEnv.live()
    finally:
        env.close()


def test_a_replay_safe_subprocess_env_starts_a_new_child_at_reset():
    env = SubprocessEnv(workload_env(), key="child", replay_safe=True)
    try:
        env.reset()
        first = env.step("first answer")
        env.kill()
        with pytest.raises(EnvProcessDied):
            env.step("second answer")
        env.reset()
        assert env.num_starts == 2
        assert env.step("first answer") == first  # the same env, built again in the new child
    finally:
        env.close()


def test_build_env_runs_the_wrapped_env_in_a_child_process_when_the_config_says_so():
    workload = Workload("t", env_median_s=0.0, failure_rate=0.0)
    args = SimpleNamespace(
        fault_injection={"env_path": "benchmarks.faults.env", "subprocess": True},
        fault_workload={"name": "t", "env_median_s": 0.0, "failure_rate": 0.0},
        live_object=threading.Lock(),  # slime's args carry objects that do not pickle: they stay behind
    )
    row = workload.rows(1)[0]
    runner = EnvFactory("engine.envs.faults", args=args)(EnvSample.from_row(row, index=0, group_index=0))
    child = runner.env.env
    assert isinstance(child, SubprocessEnv) and not child.replay_safe

    async def episode():
        await runner.reset()
        return await runner.step("first answer")

    try:
        result = anyio.run(episode)
        in_process = workload.build_env(row)
        in_process.reset()
        assert (result.observation, result.done) == in_process.step("first answer")[:2]
        assert child.is_alive and child.pid is not None
    finally:
        anyio.run(runner.close)
    assert not child.is_alive


class KillsItsChild(BaseInteractionEnv):
    """A SubprocessEnv whose child is SIGKILLed before step `at` (0-based) reaches it."""

    def __init__(self, inner: SubprocessEnv, at: int):
        self.inner, self.at, self.calls = inner, at, 0
        self.replay_safe = inner.replay_safe

    def reset(self):
        return self.inner.reset()

    def step(self, response_text):
        if self.calls == self.at:
            self.inner.kill()
        self.calls += 1
        return self.inner.step(response_text)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("replay_safe", [False, True], ids=["plain", "replay_safe"])
def test_in_the_engine_a_dead_env_process_fails_its_trajectory_unless_replay_safe(encoder, replay_safe):
    def build(sample):
        return EnvRunner(KillsItsChild(SubprocessEnv(workload_env(), replay_safe=replay_safe, key="k"), at=1),
                         step_timeout=30.0)  # fmt: skip

    retry = RetryPolicy(backoff_base_s=0.0, env_step_timeout_s=30.0)
    [trajectory] = anyio.run(functools.partial(run_engine, encoder, build, retry=retry))
    trajectory.check_invariant()
    if replay_safe:
        assert trajectory.status is not Status.FAILED, trajectory.errors
        assert trajectory.metadata["retries"] == {"env_exception": 1}
    else:
        assert trajectory.status is Status.FAILED
        assert trajectory.errors[-1].error_class is ErrorClass.ENV_EXCEPTION
        assert "died" in trajectory.errors[-1].message
    assert SubprocessEnv.live() == []


# -- a reward function that fails ---------------------------------------------------------------------------


def test_a_faulty_reward_raises_at_its_rate_the_same_calls_every_time():
    def outcomes(seed):
        reward = FaultyReward(lambda t: 1.0, 0.3, seed=seed)
        seen = []
        for group in range(50):
            for index in range(4):
                subject = SimpleNamespace(group_id=group, index=index)
                try:
                    seen.append(reward(subject))
                except RewardFault:
                    seen.append(None)
        return seen, reward

    seen, reward = outcomes(0)
    assert seen == outcomes(0)[0] and seen != outcomes(1)[0]
    assert reward.injected == seen.count(None) and reward.calls == 200
    assert 30 <= seen.count(None) <= 90  # 60 expected


def test_in_the_engine_reward_faults_are_reward_errors_retried_within_their_budget(encoder):
    def build(sample):
        return EnvRunner(StepsEnv(turns=1))

    always = FaultyReward(lambda t: 1.0, 1.0)
    trajectories = anyio.run(functools.partial(run_engine, encoder, build, prompts=2, reward_fn=always))
    budget = RetryPolicy().per_turn[ErrorClass.REWARD]
    for t in trajectories:
        assert t.status is Status.FAILED and t.errors[-1].error_class is ErrorClass.REWARD
        assert t.metadata["retries"] == {"reward": budget}
    assert always.calls == 2 * (budget + 1)

    sometimes = FaultyReward(lambda t: 1.0, 0.5, seed=1)
    trajectories = anyio.run(functools.partial(run_engine, encoder, build, prompts=8, reward_fn=sometimes))
    assert sometimes.injected > 0
    scored = [t for t in trajectories if t.status is not Status.FAILED]
    assert scored and all(t.reward == 1.0 for t in scored)
