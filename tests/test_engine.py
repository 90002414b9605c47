"""RolloutEngine and its scheduler: interleaving, groups, partial rollout, pause/resume, retries, breaker."""

from __future__ import annotations

import gc
import threading

import anyio
import pytest

from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.errors import BackendError, EnvRetryableError, ErrorClass
from engine.scheduler.reference import run_trajectory
from engine.scheduler.retry import RetryPolicy
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits
from tests.fakes import DeterministicBackend

FAST_RETRY = RetryPolicy(backoff_base_s=0.0)


class TurnsEnv(AsyncInteractionEnv):
    """Done after `num_turns` successful steps; `failures` maps a step attempt (1-based) to an exception.

    Its steps are coroutines, so runs are deterministic; with a `gate` (a threading.Event) they are
    instead plain blocking calls, run in a worker thread, that wait for the gate."""

    def __init__(self, num_turns: int, reward: float = 1.0, failures=None, replay_safe=False, gate=None):
        self.num_turns, self.reward, self.failures = num_turns, reward, dict(failures or {})
        self.replay_safe, self.gate = replay_safe, gate
        self.attempts = self.done_steps = self.resets = 0
        self.seen: list[str] = []
        if gate is not None:
            self.astep = None  # a sync env: the runner calls step() in a thread

    def reset(self):
        self.resets += 1
        self.done_steps = 0
        return {}, {}

    async def astep(self, response_text):
        return self.step(response_text)

    def step(self, response_text):
        self.attempts += 1
        if self.gate is not None:
            self.gate.wait(timeout=30)
        if (error := self.failures.pop(self.attempts, None)) is not None:
            raise error
        self.seen.append(response_text)
        self.done_steps += 1
        done = self.done_steps >= self.num_turns
        return (
            {"role": "user", "content": f"observation {self.done_steps}"},
            done,
            {"reward": self.reward} if done else {},
        )

    def format_observation(self, observation):
        return observation


def rows(n: int, turns: int = 3) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"question {i}"}], "label": str(i), "metadata": {"turns": turns}}
        for i in range(n)
    ]


def env_factory(envs: dict | None = None, **env_kwargs):
    """Builds a TurnsEnv per trajectory (turns from the row), kept in `envs` by (group, index)."""

    def build(sample):
        env = TurnsEnv(sample.metadata["turns"], reward=float(sample.index), **env_kwargs)
        if envs is not None:
            envs[(sample.group_index, sample.index)] = env
        return EnvRunner(env)

    return build


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def config(**overrides) -> EngineConfig:
    base = dict(
        n_samples_per_prompt=2, max_generating=8, max_env_steps=8, retry=FAST_RETRY,
        limits=TurnLimits(max_turns=6, max_tokens=2048), sampling=SamplingParams(max_new_tokens=24),
    )  # fmt: skip
    return EngineConfig(**{**base, **overrides})


def check_group(group, n: int) -> None:
    assert len(group.trajectories) == n and [t.index for t in group.trajectories] == list(range(n))
    for trajectory in group.trajectories:
        assert trajectory.status.is_terminal
        trajectory.check_invariant()


async def reference_tokens(encoder, row, index: int, turns: int, backend=None, max_new_tokens=24) -> list[int]:
    """The same trajectory run by the sequential reference loop."""
    trajectory = Trajectory(prompt=row["prompt"])
    await run_trajectory(
        trajectory, backend=backend or DeterministicBackend(), env=EnvRunner(TurnsEnv(turns, reward=float(index))),
        encoder=encoder, sampling=SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=encoder.stop_token_ids),
        limits=TurnLimits(max_turns=6, max_tokens=2048),
    )  # fmt: skip
    return trajectory.tokens.tolist()


# -- groups, steps, streams ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_rollout_returns_whole_groups_and_matches_the_reference_loop(encoder):
    prompts = rows(6)
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=encoder,
        env_factory=env_factory(),
        source=prompts,
        config=config(n_samples_per_prompt=3),
    ) as engine:
        steps = [await engine.rollout(2) for _ in range(3)]
        assert await engine.rollout(2) == [] and engine.statistics().is_source_exhausted
    groups = [g for step in steps for g in step]
    assert [len(step) for step in steps] == [2, 2, 2]
    assert sorted(g.group_id for g in groups) == list(range(6))
    for group in groups:
        check_group(group, 3)
        for trajectory in group.trajectories:
            assert trajectory.status is Status.COMPLETED and trajectory.reward == float(trajectory.index)
            expected = await reference_tokens(encoder, group.row, trajectory.index, 3)
            assert trajectory.tokens.tolist() == expected


@pytest.mark.anyio
async def test_stream_yields_every_group_once(encoder):
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=encoder,
        env_factory=env_factory(),
        source=rows(9, turns=2),
        config=config(max_inflight=6),
    ) as engine:
        seen = [group.group_id async for group in engine.stream()]
        stats = engine.statistics()
    assert sorted(seen) == list(range(9)) and stats.num_groups_returned == 9 and stats.num_trajectories_inflight == 0


@pytest.mark.anyio
async def test_stream_ends_when_the_source_runs_dry_exactly_at_the_inflight_limit(encoder):
    prompts = (row for row in rows(2, turns=1))  # a generator: dry only once asked for more
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=encoder,
        env_factory=env_factory(),
        source=prompts,
        config=config(max_inflight=4),
    ) as engine:
        with anyio.fail_after(10):
            assert sorted([g.group_id async for g in engine.stream()]) == [0, 1]


@pytest.mark.anyio
async def test_a_slow_env_step_holds_no_generation_slot(encoder):
    """One generation slot, one trajectory stuck in its env step: the others still generate and finish."""
    gate = threading.Event()
    backend = DeterministicBackend()

    def build(sample):
        blocked = sample.group_index == 0
        return EnvRunner(TurnsEnv(2, gate=gate if blocked else None))

    finished_first = []
    try:
        async with RolloutEngine(
            backend=backend,
            encoder=encoder,
            env_factory=build,
            source=rows(4),
            config=config(n_samples_per_prompt=1, max_generating=1),
        ) as engine:
            async for group in engine.stream():
                finished_first.append(group.group_id)
                if len(finished_first) == 3:
                    gate.set()  # only now may the stuck env step return
    finally:
        gate.set()
    assert sorted(finished_first[:3]) == [1, 2, 3] and finished_first[3] == 0
    assert backend.max_running == 1


# -- partial rollout ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_partial_rollout_pauses_the_rest_and_resumes_them_first(encoder):
    backend = DeterministicBackend(stop_every=30)
    prompts = rows(8)
    requests: list[list[int]] = []
    generate = backend.generate

    async def recording_generate(input_ids, *args, **kwargs):
        requests.append(list(input_ids))
        return await generate(input_ids, *args, **kwargs)

    backend.generate = recording_generate
    cfg = config(partial_rollout=True, over_sampling=3.0, sampling=SamplingParams(max_new_tokens=64))
    async with RolloutEngine(
        backend=backend, encoder=encoder, env_factory=env_factory(), source=prompts, config=cfg
    ) as engine:
        first = await engine.rollout(2)
        assert backend.running == {}  # nothing left on the backend
        await engine.wait_until_parked()  # env steps in progress finish first
        leftovers = engine.open_groups
        held = set(range(engine.statistics().num_prompts_admitted)) - {g.group_id for g in first}
        waiting = [t for g in leftovers for t in g.trajectories if not t.is_ended]
        assert len(held) == 4 and leftovers and waiting and all(t.status is Status.PAUSED for t in waiting)
        assert any(t.turns[-1].finish_reason == "abort" and t.turns[-1].num_generated > 0 for t in waiting)
        before = len(requests)
        backend.version = "v1"
        second = await engine.rollout(4)
        stats = engine.statistics().scheduler
    # paused trajectories got their generation slots before any new trajectory
    paused_prefixes = {tuple(t.tokens[: t.prompt_length]) for t in waiting}
    resumed = [tuple(ids) for ids in requests[before : before + len(waiting)]]
    assert len(resumed) == len(waiting) and all(any(ids[: len(p)] == p for p in paused_prefixes) for ids in resumed)
    assert stats.num_paused >= len(waiting) and stats.num_resumed >= len(waiting)
    for group in first + second:
        check_group(group, 2)
        for trajectory in group.trajectories:  # an aborted and resumed turn continues exactly where it stopped
            expected = await reference_tokens(
                encoder, group.row, trajectory.index, 3, DeterministicBackend(stop_every=30), 64
            )
            assert trajectory.tokens.tolist() == expected
    resumed_versions = [t.weight_versions for g in second for t in g.trajectories]
    assert any("v0" in v and "v1" in v for v in resumed_versions)  # per-generation weight versions carried


class HeldEnv(AsyncInteractionEnv):
    """Done after one step; a step of a trajectory in `held` first says so (`entered`) and then waits for
    `release`."""

    def __init__(self, key, held: set, entered: dict, release: anyio.Event):
        self.key, self.held, self.entered, self.release = key, held, entered, release

    def reset(self):
        return {}, {}

    async def astep(self, response_text):
        if self.key in self.held:
            self.entered[self.key].set()
            await self.release.wait()
        return {"role": "user", "content": "ok"}, True, {"reward": 1.0}

    def format_observation(self, observation):
        return observation


def held_envs(held: set):
    entered, release = {key: anyio.Event() for key in held}, anyio.Event()

    def build(sample):
        return EnvRunner(HeldEnv((sample.group_index, sample.index), held, entered, release))

    return build, entered, release


@pytest.mark.anyio
async def test_refill_starts_groups_in_the_step_tail_and_the_step_ends_without_its_straggler(encoder):
    """Group 1's second member is held in its env: without refill the step could only wait for it. With
    refill, the step's tail (two trajectories live, four generation slots) starts group 2, and the step
    returns groups 0 and 2 while group 1 waits for the next step."""
    build, _, release = held_envs({(1, 1)})
    cfg = config(partial_rollout=True, refill=1.0, max_generating=4)
    async with RolloutEngine(
        backend=DeterministicBackend(stop_every=8), encoder=encoder, env_factory=build, source=rows(8), config=cfg
    ) as engine:
        with anyio.fail_after(20):
            first = await engine.rollout(2)
        assert sorted(g.group_id for g in first) == [0, 2] and not release.is_set()
        assert engine.statistics().num_prompts_admitted == 3  # the step ended at once when group 2 was done
        assert [g.group_id for g in engine.open_groups] == [1]
        release.set()
        with anyio.fail_after(20):
            second = await engine.rollout(2)
    assert 1 in {g.group_id for g in second}
    for group in first + second:
        check_group(group, 2)


@pytest.mark.anyio
async def test_refill_starts_at_most_target_times_refill_groups_more(encoder):
    """Target 2 at refill 0.5: one group more than the step's two, however many slots are free."""
    build, entered, release = held_envs({(1, 1), (2, 1)})
    cfg = config(partial_rollout=True, refill=0.5, max_generating=64)
    async with (
        RolloutEngine(
            backend=DeterministicBackend(stop_every=8), encoder=encoder, env_factory=build, source=rows(8), config=cfg
        ) as engine,
        anyio.create_task_group() as tasks,
    ):
        tasks.start_soon(engine.rollout, 2)
        with anyio.fail_after(20):
            await entered[(1, 1)].wait()
            await entered[(2, 1)].wait()
        assert engine.statistics().num_prompts_admitted == 3  # 2 + ceil(2 x 0.5), though 61 slots are free
        release.set()


@pytest.mark.anyio
@pytest.mark.parametrize("on_stale", ["restart", "finish"])
async def test_too_stale_trajectories_restart_or_finish(encoder, on_stale):
    backend = DeterministicBackend(stop_every=30)
    cfg = config(
        partial_rollout=True,
        over_sampling=3.0,
        max_staleness=0,
        on_stale=on_stale,
        sampling=SamplingParams(max_new_tokens=64),
    )
    async with RolloutEngine(
        backend=backend, encoder=encoder, env_factory=env_factory(), source=rows(6), config=cfg
    ) as engine:
        await engine.rollout(1)
        await engine.wait_until_parked()
        paused = [t for g in engine.open_groups for t in g.trajectories if t.status is Status.PAUSED and t.spans]
        assert paused
        backend.version = "v1"
        await engine.resume("v1")
        groups = [g async for g in engine.stream()]
        stats = engine.statistics().scheduler
    ended = {(t.group_id, t.index): t for g in groups for t in g.trajectories}
    for old in paused:
        trajectory = ended[(old.group_id, old.index)]
        if on_stale == "restart":
            assert trajectory.metadata["num_restarts"] == 1 and trajectory.status is Status.COMPLETED
            assert set(trajectory.weight_versions) == {"v1"}  # nothing of v0 is left
        else:
            assert (trajectory.status, trajectory.stop_reason) == (Status.ABORTED, StopReason.STALE)
            assert "v0" in trajectory.weight_versions
    if on_stale == "restart":
        assert stats.num_restarted == len(paused) and stats.num_discarded_tokens > 0
    else:
        assert stats.num_finished_stale == len(paused)


@pytest.mark.anyio
async def test_finished_members_of_a_group_gone_too_stale_run_again(encoder):
    """No returned token is older than max_staleness: a member that ended before an update, in a group
    still open after it, is run again."""
    backend = DeterministicBackend(stop_every=30)

    def build(sample):  # member 0 ends after one turn, member 1 runs long
        return EnvRunner(TurnsEnv(1 if sample.index == 0 else 4, reward=float(sample.index)))

    cfg = config(partial_rollout=True, over_sampling=3.0, max_staleness=0, sampling=SamplingParams(max_new_tokens=64))
    async with RolloutEngine(backend=backend, encoder=encoder, env_factory=build, source=rows(6), config=cfg) as engine:
        await engine.rollout(1)
        await engine.wait_until_parked()
        stale = {(g.group_id, t.index): t for g in engine.open_groups for t in g.trajectories if t.is_ended}
        assert stale
        backend.version = "v1"
        await engine.resume("v1")
        groups = [g async for g in engine.stream()]
        stats = engine.statistics().scheduler
    for group in groups:
        for trajectory in group.trajectories:
            if (group.group_id, trajectory.index) in stale:
                assert trajectory is not stale[(group.group_id, trajectory.index)]
                assert trajectory.metadata["num_restarts"] == 1 and set(trajectory.weight_versions) == {"v1"}
    assert stats.num_restarted >= len(stale)


@pytest.mark.anyio
async def test_mask_offpolicy_zeroes_tokens_from_before_the_update(encoder):
    backend = DeterministicBackend(stop_every=30)
    cfg = config(
        partial_rollout=True, over_sampling=3.0, mask_offpolicy=True, sampling=SamplingParams(max_new_tokens=64)
    )
    async with RolloutEngine(
        backend=backend, encoder=encoder, env_factory=env_factory(), source=rows(6), config=cfg
    ) as engine:
        await engine.rollout(1)
        backend.version = "v1"
        await engine.resume("v1")
        groups = [g async for g in engine.stream()]
    mixed = [t for g in groups for t in g.trajectories if {"v0", "v1"} <= set(t.weight_versions)]
    assert mixed
    for trajectory in mixed:
        for span in trajectory.spans:
            mask = trajectory.loss_mask[span.start : span.start + span.length].tolist()
            assert mask == [0 if span.weight_version == "v0" else 1] * span.length


@pytest.mark.anyio
async def test_pause_stops_generation_while_env_steps_go_on(encoder):
    gate = threading.Event()
    envs: dict = {}
    backend = DeterministicBackend()
    async with (
        RolloutEngine(
            backend=backend,
            encoder=encoder,
            env_factory=env_factory(envs, gate=gate),
            source=rows(1),
            config=config(n_samples_per_prompt=1),
        ) as engine,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(engine.rollout, 1)
        while engine.statistics().scheduler.env.borrowed == 0:  # until the first env step is under way
            await anyio.wait_all_tasks_blocked()
            await anyio.lowlevel.checkpoint()
        await engine.pause()
        calls = backend.num_calls
        gate.set()  # the env step goes on while generation is paused
        await engine.wait_until_parked()
        assert envs[(0, 0)].done_steps == 1 and backend.num_calls == calls
        await engine.resume("v1")
    assert envs[(0, 0)].done_steps == 3


# -- retries and the breaker --------------------------------------------------------------------


@pytest.mark.anyio
async def test_backend_errors_within_budget_are_retried_invisibly(encoder):
    failures = {1: BackendError(ErrorClass.SERVER, "HTTP 503"), 3: BackendError(ErrorClass.CONNECTION, "refused")}
    backend = DeterministicBackend(failures=failures)
    async with RolloutEngine(
        backend=backend,
        encoder=encoder,
        env_factory=env_factory(),
        source=rows(1),
        config=config(n_samples_per_prompt=1),
    ) as engine:
        [group] = await engine.rollout(1)
        stats = engine.statistics().scheduler
    [trajectory] = group.trajectories
    assert trajectory.status is Status.COMPLETED and trajectory.errors == []
    assert trajectory.tokens.tolist() == await reference_tokens(encoder, group.row, 0, 3)
    assert stats.retries == {ErrorClass.SERVER: 1, ErrorClass.CONNECTION: 1}
    assert sum(turn.retries for turn in trajectory.turns) == 2


@pytest.mark.anyio
async def test_a_spent_budget_fails_the_trajectory_with_its_reason_and_keeps_the_group_whole(encoder):
    backend = DeterministicBackend(failures={1: BackendError(ErrorClass.CLIENT, "HTTP 400: bad input_ids")})
    async with RolloutEngine(
        backend=backend, encoder=encoder, env_factory=env_factory(), source=rows(1), config=config()
    ) as engine:
        [group] = await engine.rollout(1)
        stats = engine.statistics().scheduler
    check_group(group, 2)
    failed = [t for t in group.trajectories if t.status is Status.FAILED]
    assert len(failed) == 1 and failed[0].stop_reason is StopReason.BACKEND_ERROR
    assert "HTTP 400" in failed[0].errors[0].message and "retry budget spent" in failed[0].errors[0].message
    assert stats.budgets_exhausted == {ErrorClass.CLIENT: 1}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("error", "replay_safe", "outcome"),
    [
        (EnvRetryableError("sandbox busy"), False, "as_is"),  # the env says the same step may run again
        (EnvRetryableError("sandbox busy"), True, "as_is"),
        (RuntimeError("tool crashed"), True, "replayed"),  # reset, the earlier turns stepped again, then retried
        (RuntimeError("tool crashed"), False, "failed"),  # the action may have happened: never run twice
    ],
)
async def test_env_errors_retry_as_is_replayed_or_not_at_all(encoder, error, replay_safe, outcome):
    envs: dict = {}
    factory = env_factory(envs, failures={2: error}, replay_safe=replay_safe)
    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=encoder,
        env_factory=factory,
        source=rows(1),
        config=config(n_samples_per_prompt=1, max_failed_share=1.0),
    ) as engine:
        [group] = await engine.rollout(1)
    [trajectory] = group.trajectories
    env = envs[(0, 0)]
    if outcome == "failed":
        assert (trajectory.status, trajectory.stop_reason) == (Status.FAILED, StopReason.ENV_ERROR)
        assert "not retried: env TurnsEnv is not replay_safe" in trajectory.errors[-1].message
        assert env.attempts == 2 and len(env.seen) == 1  # the failed step was not run again
        return
    assert trajectory.status is Status.COMPLETED and trajectory.turns[1].retries == 1
    assert trajectory.tokens.tolist() == await reference_tokens(encoder, group.row, 0, 3)
    if outcome == "replayed":
        assert env.resets == 2 and env.seen[0] == env.seen[1] and len(env.seen) == 4
    else:
        assert env.resets == 1 and len(env.seen) == 3


class SlowOnce(TurnsEnv):
    """A sync env whose steps hang (in their worker thread) until `gate` is set."""

    def step(self, response_text):
        if not self.gate.is_set():
            self.attempts += 1
            self.gate.wait(timeout=30)  # hangs until the test ends
            raise AssertionError("abandoned attempt returned")
        return super().step(response_text)


@pytest.mark.anyio
@pytest.mark.parametrize("replay_safe", [True, False])
async def test_an_env_step_past_its_timeout_is_retried_on_a_fresh_env_only_where_replay_safe(encoder, replay_safe):
    gate = threading.Event()
    built: list[SlowOnce] = []

    def build(sample):
        env = SlowOnce(2, gate=gate if not built else _open_gate(), replay_safe=replay_safe)
        built.append(env)
        return EnvRunner(env)

    retry = RetryPolicy(backoff_base_s=0.0, env_step_timeout_s=0.2)
    try:
        async with RolloutEngine(
            backend=DeterministicBackend(), encoder=encoder, env_factory=build,
            source=rows(1), config=config(n_samples_per_prompt=1, retry=retry, max_failed_share=1.0),
        ) as engine:  # fmt: skip
            [group] = await engine.rollout(1)
            stats = engine.statistics().scheduler
        [trajectory] = group.trajectories
        assert built[0].attempts == 1  # the hung env is never called again, its thread still running
        if replay_safe:
            assert trajectory.status is Status.COMPLETED and stats.retries == {ErrorClass.ENV_TIMEOUT: 1}
            assert len(built) == 2 and built[1].resets == 1
        else:
            assert (trajectory.status, trajectory.stop_reason) == (Status.FAILED, StopReason.ENV_ERROR)
            assert trajectory.errors[-1].error_class is ErrorClass.ENV_TIMEOUT and len(built) == 1
    finally:
        gate.set()


class Hung(TurnsEnv):
    """A sync, replay-safe env whose every step hangs in its worker thread until `gate` is set."""

    def __init__(self, gate: threading.Event, closed: list[int]):
        super().__init__(2, gate=gate, replay_safe=True)
        self.closed = closed

    def close(self):
        self.closed.append(threading.get_ident())


@pytest.mark.anyio
async def test_a_hung_env_fails_its_trajectory_without_waiting_for_the_calls_it_left_running(encoder):
    """Every step hangs: each try times out and the retry builds a fresh env, never waiting for the call left
    running (the env is closed by that call's thread once it returns). The trajectory fails on its spent budget
    while all three calls still run, and the engine names them."""
    gate, closed = threading.Event(), []
    retry = RetryPolicy(backoff_base_s=0.0, env_step_timeout_s=0.2, per_turn={ErrorClass.ENV_TIMEOUT: 2})
    try:
        async with RolloutEngine(
            backend=DeterministicBackend(), encoder=encoder, env_factory=lambda sample: EnvRunner(Hung(gate, closed)),
            source=rows(1), config=config(n_samples_per_prompt=1, retry=retry, max_failed_share=1.0),
        ) as engine:  # fmt: skip
            with anyio.fail_after(20):
                [group] = await engine.rollout(1)
        [trajectory] = group.trajectories
        assert (trajectory.status, trajectory.stop_reason) == (Status.FAILED, StopReason.ENV_ERROR)
        assert trajectory.metadata["retries"] == {"env_timeout": 2} and trajectory.turns[0].retries == 2
        assert not gate.is_set() and closed == []  # failed while every call still hangs, none closed under it
        left = engine.abandoned_env_calls
        assert len(left) == 3 and left.describe().count("Hung.step (running ") == 3
        assert not left.wait(0.05)
    finally:
        gate.set()
    assert await anyio.to_thread.run_sync(left.wait, 10) and len(left) == 0
    assert len(closed) == 3  # each env closed by the thread of its own call, once that returned


def _open_gate() -> threading.Event:
    gate = threading.Event()
    gate.set()
    return gate


@pytest.mark.anyio
async def test_the_breaker_stops_admissions_while_everything_fails_and_loses_nothing(encoder, caplog):
    class DownBackend(DeterministicBackend):
        async def generate(self, *args, **kwargs):
            await anyio.lowlevel.checkpoint()
            raise BackendError(ErrorClass.CONNECTION, "SGLang server at http://10.0.0.9:30000 is unreachable")

    retry = RetryPolicy(backoff_base_s=0.0, per_trajectory=1)
    cfg = config(n_samples_per_prompt=2, max_inflight=4, retry=retry, breaker_min_attempts=4, breaker_window_s=0.2)
    async with RolloutEngine(
        backend=DownBackend(), encoder=encoder, env_factory=env_factory(), source=rows(6), config=cfg
    ) as engine:
        groups = [g async for g in engine.stream()]
        stats = engine.statistics()
    assert stats.scheduler.breaker.times_opened >= 1 and "breaker open" in caplog.text
    assert sorted(g.group_id for g in groups) == list(range(6))  # admitted later, once the window moved on
    assert all(
        t.status is Status.FAILED and "unreachable" in t.errors[0].message for g in groups for t in g.trajectories
    )


@pytest.mark.anyio
async def test_zero_spread_groups_are_dropped_counted_and_replaced(encoder):
    def build(sample):  # group 0 and 2: every member gets the same reward
        return EnvRunner(TurnsEnv(1, reward=1.0 if sample.group_index % 2 == 0 else float(sample.index)))

    async with RolloutEngine(
        backend=DeterministicBackend(),
        encoder=encoder,
        env_factory=build,
        source=rows(6),
        config=config(drop_zero_std=True),
    ) as engine:
        groups = await engine.rollout(2)
        stats = engine.statistics()
    assert sorted(g.group_id for g in groups) == [1, 3]
    assert stats.num_groups_dropped == {"zero_std": 2} and stats.num_prompts_admitted == 4


# -- the process ------------------------------------------------------------------------------------


def _is_collected(obj: object) -> bool:
    """Whether the collector's passes look at `obj` (a frozen object is in no generation they visit)."""
    return any(o is obj for o in gc.get_objects())


@pytest.mark.anyio
async def test_the_first_engine_freezes_what_is_alive_and_a_later_one_leaves_the_collector_alone(encoder, monkeypatch):
    import engine.gc_freeze as engine_module

    monkeypatch.setattr(engine_module, "_frozen", False)
    gc.unfreeze()
    before = [object()]  # a container alive when the first engine starts
    async with RolloutEngine(
        backend=DeterministicBackend(), encoder=encoder, env_factory=env_factory(), source=rows(2), config=config()
    ) as engine:
        groups = await engine.rollout(2)
    assert len(groups) == 2 and not _is_collected(before) and gc.get_freeze_count() > 0
    between = [object()]
    async with RolloutEngine(
        backend=DeterministicBackend(), encoder=encoder, env_factory=env_factory(), source=rows(2), config=config()
    ) as engine:
        await engine.rollout(2)
    assert _is_collected(between)  # frozen once per process: what a later engine holds is collected as before


@pytest.mark.anyio
async def test_gc_freeze_false_leaves_the_collector_as_it_is(encoder, monkeypatch):
    import engine.gc_freeze as engine_module

    monkeypatch.setattr(engine_module, "_frozen", False)
    gc.unfreeze()
    before = [object()]
    async with RolloutEngine(
        backend=DeterministicBackend(), encoder=encoder, env_factory=env_factory(), source=rows(2),
        config=config(gc_freeze=False),
    ) as engine:  # fmt: skip
        await engine.rollout(2)
    assert _is_collected(before) and gc.get_freeze_count() == 0 and engine_module._frozen is False
