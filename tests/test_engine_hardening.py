"""Nothing one trajectory does takes the engine down: every failure is that trajectory's (or group's) alone.

Each test breaks one thing (an unclassified exception, a template that raises, a formatter that fails, a
weight update while an env step runs, a pause raced by a resume, two callers waiting at once, slime's own
abort) and checks that the trajectory it belongs to ends with that failure recorded while the rest, and
the engine, go on.
"""

from __future__ import annotations

import threading

import anyio
import pytest

from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.envs.loader import EnvFactory, EnvSample
from engine.errors import ErrorClass
from engine.models import load_tokenizer
from engine.scheduler.retry import CircuitBreaker
from engine.trajectory import Status, StopReason, Trajectory
from tests.fakes import DeterministicBackend
from tests.test_engine import TurnsEnv, config, env_factory, rows

# Mistral-Nemo's rule on tool messages, in front of the embedded Qwen2.5 tokenizer's own template: a tool
# message whose id is not 9 characters makes the template raise, as Mistral's does.
STRICT_TOOL_IDS = (
    "{%- for m in messages %}{%- if m.role == 'tool' and (m.tool_call_id | length) != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{%- endfor %}"
)


def run_engine(encoder, source, *, backend=None, env=None, **cfg):
    return RolloutEngine(
        backend=backend or DeterministicBackend(), encoder=encoder, env_factory=env or env_factory(),
        source=source, config=config(**{"max_failed_share": 1.0, **cfg}),
    )  # fmt: skip


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


@pytest.fixture(scope="module")
def strict_encoder(tokenizer):
    return ChatEncoder(load_tokenizer("qwen2.5", chat_template=STRICT_TOOL_IDS + tokenizer.chat_template))


# -- failure is data ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_unclassified_exception_fails_only_its_trajectory_and_the_engine_goes_on(encoder):
    backend = DeterministicBackend(failures={2: ValueError("no room left to generate")})
    async with run_engine(encoder, rows(3), backend=backend) as engine:
        first = await engine.rollout(2)
        second = await engine.rollout(1)  # the engine still serves
    ended = [t for g in first + second for t in g.trajectories]
    failed = [t for t in ended if t.status is Status.FAILED]
    assert len(ended) == 6 and len(failed) == 1
    [error] = failed[0].errors
    assert (failed[0].stop_reason, error.error_class) == (StopReason.INTERNAL_ERROR, ErrorClass.INTERNAL)
    assert "ValueError('no room left to generate')" in error.message
    assert all(t.status is Status.COMPLETED for t in ended if t is not failed[0])


class ToolEnv(AsyncInteractionEnv):
    """Answers with a tool message; the id is `bad_id` for member 0, a valid 9-character one otherwise."""

    def __init__(self, index: int):
        self.tool_call_id = "call_1" if index == 0 else "abcdefghi"

    async def astep(self, response_text):
        return {"obs_str": "42"}, False, {}

    def format_observation(self, observation):
        return {"role": "tool", "tool_call_id": self.tool_call_id, "content": observation["obs_str"]}


@pytest.mark.anyio
async def test_a_template_that_raises_on_an_observation_fails_that_trajectory_as_bad_observation(strict_encoder):
    async with run_engine(strict_encoder, rows(1), env=lambda sample: EnvRunner(ToolEnv(sample.index))) as engine:
        [group] = await engine.rollout(1)
    bad, good = group.trajectories
    assert (bad.status, bad.stop_reason) == (Status.FAILED, StopReason.ENCODE_ERROR)
    assert bad.errors[-1].error_class is ErrorClass.BAD_OBSERVATION
    assert "Tool call IDs should be alphanumeric strings with length 9!" in bad.errors[-1].message
    assert (good.status, good.stop_reason) == (Status.COMPLETED, StopReason.MAX_TURNS)


@pytest.mark.anyio
async def test_a_prompt_the_template_refuses_fails_its_group_as_bad_prompt_and_others_run(strict_encoder):
    bad_row = {
        "prompt": [
            {"role": "user", "content": "what is 6 * 7?"},
            {"role": "tool", "tool_call_id": "x", "content": "42"},
        ],
        "metadata": {"turns": 1},
    }
    async with run_engine(strict_encoder, [bad_row, *rows(1, turns=1)]) as engine:
        groups = sorted(await engine.rollout(2), key=lambda g: g.group_id)
    assert {(t.status, t.stop_reason) for t in groups[0].trajectories} == {(Status.FAILED, StopReason.ENCODE_ERROR)}
    assert groups[0].trajectories[0].errors[-1].error_class is ErrorClass.BAD_PROMPT
    assert {t.status for t in groups[1].trajectories} == {Status.COMPLETED}


@pytest.mark.anyio
async def test_a_failing_format_observation_is_retried_without_stepping_the_env_again(encoder):
    envs: dict = {}

    class FormatsOnSecondTry(TurnsEnv):
        formats = 0

        def format_observation(self, observation):
            self.formats += 1
            if self.formats == 1:
                raise KeyError("obs_str")
            return observation

    def build(sample):
        envs[sample.index] = env = FormatsOnSecondTry(2)
        return EnvRunner(env)

    async with run_engine(encoder, rows(1), env=build, n_samples_per_prompt=1) as engine:
        [group] = await engine.rollout(1)
    [trajectory] = group.trajectories
    assert trajectory.status is Status.COMPLETED and trajectory.metadata["retries"] == {"env_exception": 1}
    assert envs[0].attempts == 2 and envs[0].formats == 2  # two steps, each once; the first formatted twice


@pytest.mark.anyio
async def test_a_drift_check_that_raises_fails_that_trajectory(encoder):
    class Broken(ChatEncoder):
        def drift_check(self, trajectory):
            raise RuntimeError("the template cannot render the whole conversation")

    broken = Broken(encoder.tokenizer)
    async with run_engine(broken, rows(1), drift_check_every=1) as engine:
        [group] = await engine.rollout(1)
    for trajectory in group.trajectories:
        assert (trajectory.status, trajectory.stop_reason) == (Status.FAILED, StopReason.ENCODE_ERROR)
        assert "the drift check could not re-render" in trajectory.errors[-1].message


# -- staleness when a trajectory ends -------------------------------------------------------------


class GatedEnv(TurnsEnv):
    """In run `r` (counted by resets) its last step sets `gates[r][0]` and waits for `gates[r][1]`."""

    def __init__(self, num_turns, gates):
        super().__init__(num_turns)
        self.gates = gates

    async def astep(self, response_text):
        run = self.resets - 1
        if self.done_steps == self.num_turns - 1 and run < len(self.gates):
            entered, release = self.gates[run]
            entered.set()
            await release.wait()
        return self.step(response_text)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("on_stale", "updates", "max_restarts", "expected"),
    [
        ("restart", 1, 2, (Status.COMPLETED, StopReason.ENV_DONE, 1)),  # ran again on the new weights
        ("restart", 2, 1, (Status.ABORTED, StopReason.STALE, 1)),  # stale again after its one restart
        ("finish", 1, 2, (Status.ABORTED, StopReason.STALE, 0)),
    ],
)
async def test_the_staleness_bound_holds_for_a_trajectory_that_ends_after_a_weight_update(
    encoder, on_stale, updates, max_restarts, expected
):
    """A weight update lands while the trajectory is in its last env step: ending after it, it would be
    returned older than `max_staleness`; it runs again (within `max_restarts`) or ends STALE instead."""
    backend = DeterministicBackend()
    gates = [(anyio.Event(), anyio.Event()) for _ in range(updates)]
    cfg = dict(n_samples_per_prompt=1, max_staleness=0, on_stale=on_stale, max_restarts=max_restarts)
    result: list = []
    env = lambda sample: EnvRunner(GatedEnv(2, gates))  # noqa: E731
    async with run_engine(encoder, rows(1), backend=backend, env=env, **cfg) as engine, anyio.create_task_group() as tg:

        async def step():
            result.extend(await engine.rollout(1))

        tg.start_soon(step)
        for version, (entered, release) in enumerate(gates, start=1):
            await entered.wait()  # in its last env step, on older weights
            await engine.pause()
            backend.version = f"v{version}"
            await engine.resume(f"v{version}")
            release.set()
    [group] = result
    [trajectory] = group.trajectories
    status, stop, restarts = expected
    assert (trajectory.status, trajectory.stop_reason) == (status, stop)
    assert trajectory.metadata.get("num_restarts", 0) == restarts
    if status is Status.COMPLETED:
        assert set(trajectory.weight_versions) == {f"v{updates}"}  # nothing older than the bound is returned


# -- waiting, pausing, resuming -------------------------------------------------------------------


@pytest.mark.anyio
async def test_two_streams_at_once_share_every_group_and_neither_hangs(encoder):
    taken: list[list[int]] = [[], []]
    async with run_engine(encoder, rows(8), max_inflight=4) as engine:
        with anyio.fail_after(60):  # a lost wake-up would hang one of them
            async with anyio.create_task_group() as tg:
                for mine in taken:

                    async def consume(mine=mine):
                        async for group in engine.stream():
                            mine.append(group.group_id)

                    tg.start_soon(consume)
    assert sorted(taken[0] + taken[1]) == list(range(8))


class StubbornBackend(DeterministicBackend):
    """Ignores aborts: a request runs until `finish` is set."""

    def __init__(self):
        super().__init__()
        self.finish = anyio.Event()
        self.started = anyio.Event()
        self.aborts = 0

    async def generate(self, input_ids, sampling_params, *args, **kwargs):
        self.started.set()
        await self.finish.wait()
        return await super().generate(input_ids, sampling_params, *args, **kwargs)

    async def abort(self, rid=None) -> None:
        self.aborts += 1


@pytest.mark.anyio
async def test_a_resume_while_a_pause_waits_for_requests_ends_the_pause(encoder):
    backend = StubbornBackend()
    async with (
        run_engine(encoder, rows(1), backend=backend, n_samples_per_prompt=1) as engine,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(engine.rollout, 1)
        await backend.started.wait()
        paused = anyio.Event()

        async def pause():
            await engine.pause()
            paused.set()

        tg.start_soon(pause)
        await anyio.wait_all_tasks_blocked()
        assert backend.aborts == 1 and not paused.is_set()  # waiting for the request to come back
        await engine.resume("v0")
        with anyio.fail_after(10):
            await paused.wait()  # the pause gives up once generation is resumed
        backend.finish.set()


# -- slime's generate path --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_run_one_counts_in_flight_has_its_own_group_and_ends_aborted_on_an_abort_not_its_own(encoder):
    class Slow(DeterministicBackend):
        def __init__(self):
            super().__init__(stop_every=10_000)
            self.started = anyio.Event()

        async def generate(self, *args, **kwargs):
            self.started.set()
            return await super().generate(*args, **kwargs)

    backend = Slow()
    trajectory = Trajectory(prompt=[{"role": "user", "content": "question 9"}], metadata={"turns": 3})
    async with run_engine(
        encoder, rows(1), backend=backend, n_samples_per_prompt=1,
        sampling=config().sampling.__class__(max_new_tokens=5_000),
    ) as engine:  # fmt: skip
        [group] = await engine.rollout(1)
        backend.started = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run_one, trajectory, EnvSample(metadata={"turns": 3}, index=0))
            await backend.started.wait()
            assert engine.statistics().num_trajectories_inflight == 1
            await backend.abort()  # slime aborts every request at the end of its step
        assert engine.statistics().num_trajectories_inflight == 0
    assert (trajectory.status, trajectory.stop_reason) == (Status.ABORTED, StopReason.ABORTED)
    assert trajectory.turns[-1].finish_reason == "abort" and trajectory.group_id != group.group_id


# -- blocking work off the loop, read-only statistics ---------------------------------------------


@pytest.mark.anyio
async def test_a_user_build_env_runs_off_the_event_loop(encoder, tmp_path):
    module = tmp_path / "threaded_env.py"
    module.write_text(
        "import threading\n"
        "from tests.test_engine import TurnsEnv\n"
        "THREADS = []\n"
        "def build_env(sample=None, args=None):\n"
        "    THREADS.append(threading.get_ident())\n"
        "    return TurnsEnv(1)\n"
    )
    factory = EnvFactory(str(module))
    async with run_engine(encoder, rows(1), env=factory) as engine:
        await engine.rollout(1)
    assert factory.module.THREADS and threading.get_ident() not in factory.module.THREADS


def test_breaker_statistics_change_nothing(caplog):
    now = [0.0]
    breaker = CircuitBreaker(threshold=0.5, window_s=10, min_attempts=2, clock=lambda: now[0])
    breaker.record(False)
    breaker.record(False)
    assert breaker.is_open
    now[0] = 20.0
    snapshot = breaker.statistics()  # as the exporter's thread reads it
    assert (snapshot.is_open, snapshot.attempts, snapshot.times_opened) == (False, 0, 1)
    assert "breaker closed" not in caplog.text  # only the engine's own reads move the breaker on
    assert not breaker.is_open and "breaker closed" in caplog.text


@pytest.mark.anyio
@pytest.mark.parametrize("failures", [1, 99])
async def test_an_env_factory_that_raises_is_an_env_exception_retried_within_the_budget(encoder, failures):
    calls = {"n": 0}

    def build(sample):
        calls["n"] += 1
        if calls["n"] <= failures:
            raise RuntimeError("sandbox quota exceeded")
        return EnvRunner(TurnsEnv(1))

    async with run_engine(encoder, rows(1), env=build, n_samples_per_prompt=1) as engine:
        [group] = await engine.rollout(1)
    [trajectory] = group.trajectories
    if failures == 1:  # built again once (the env_exception budget of a turn), then it runs
        assert trajectory.status is Status.COMPLETED and trajectory.metadata["retries"] == {"env_exception": 1}
    else:
        assert (trajectory.status, trajectory.stop_reason) == (Status.FAILED, StopReason.ENV_ERROR)
        [error] = trajectory.errors
        assert error.error_class is ErrorClass.ENV_EXCEPTION
        assert "building the env raised RuntimeError('sandbox quota exceeded')" in error.message
        assert calls["n"] == 2
