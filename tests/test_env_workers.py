"""Envs hosted in Ray actors (engine/envs/ray_workers.py), against a real local Ray shared by the module:
they run in the workers' processes, each env in one worker for its whole trajectory (a pause of partial
rollout included); a worker killed mid-step fails the trajectories it held with env_worker_lost, or,
for replay-safe envs, they are retried on a fresh env and complete; the pool replaces the dead worker;
nothing is lost.

The env (ENV_SOURCE, written to a file the workers load by path) names its process, its own identity
and its step count in every observation, so each turn's kept message says where that step ran. A step
listed in the row's `gated` waits at a gate actor until the test releases it, so the test knows every
trajectory is mid-step when it kills a worker.
"""

from __future__ import annotations

import asyncio
import os
import re
from contextlib import closing

import anyio
import pytest

from engine.backends.base import SamplingParams
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.loader import EnvFactory
from engine.errors import ErrorClass
from engine.scheduler.retry import DEFAULT_PER_TURN, RetryPolicy
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits
from tests.fakes import DeterministicBackend

ray = pytest.importorskip("ray", reason="Ray is part of the dev extra; install it with `pip install -e .[dev]`")
from engine.envs.ray_workers import EnvWorkerPool, hosted  # noqa: E402 -- needs Ray

pytestmark = pytest.mark.slow

NAMESPACE = "turnstile-env-workers-test"
GATE = "env-gate"
WAIT_S = 60.0  # for every trajectory to reach the gate (workers start in a few seconds)
ENV_SOURCE = f"""
import itertools
import os
import threading

import ray

from engine.envs.base import BaseInteractionEnv

_thread = threading.local()
_thread_numbers = itertools.count()


def thread_number():
    \"\"\"A number for the thread this runs on, new for every thread the process starts.\"\"\"
    if not hasattr(_thread, "number"):
        _thread.number = next(_thread_numbers)
    return _thread.number


class WhereEnv(BaseInteractionEnv):
    def __init__(self, key, turns, gated, replay_safe, reset_fails):
        self.key, self.turns, self.gated, self.replay_safe = key, turns, gated, replay_safe
        self.reset_fails = reset_fails
        self.steps = 0

    def reset(self):
        if self.reset_fails:
            raise OSError("the sandbox did not come up")
        self.steps = 0
        return {{}}, {{}}

    def step(self, response_text):
        self.steps += 1
        if self.steps in self.gated:
            ray.get(ray.get_actor({GATE!r}).arrive.remote(self.key, os.getpid()))
        done = self.steps >= self.turns
        text = f"pid={{os.getpid()}} env={{id(self)}} step={{self.steps}} thread={{thread_number()}}"
        return {{"obs_str": text}}, done, {{"reward": 1.0}}


def build_env(sample=None, args=None, **kw):
    meta = sample.metadata
    if meta.get("refuse"):
        raise KeyError("no sandbox for this task")
    key = (sample.group_index, sample.index)
    gated, replay_safe = set(meta.get("gated", ())), bool(meta.get("replay_safe"))
    return WhereEnv(key, meta.get("turns", 3), gated, replay_safe, bool(meta.get("reset_fails")))
"""
RETRY = RetryPolicy(backoff_base_s=0.0, per_turn={**DEFAULT_PER_TURN, ErrorClass.ENV_WORKER_LOST: 2})


@ray.remote
class Gate:
    """Steps arrive (key, pid) and wait until released; the test waits for a number of arrivals."""

    def __init__(self):
        self.arrived: dict[tuple[int, int], int] = {}
        self.released = asyncio.Event()
        self.changed = asyncio.Condition()

    async def arrive(self, key, pid):
        async with self.changed:
            self.arrived[tuple(key)] = pid
            self.changed.notify_all()
        await self.released.wait()

    async def wait_for(self, n):
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.arrived) >= n)
        return dict(self.arrived)

    async def release(self):
        self.released.set()


@pytest.fixture(scope="module")
def local_ray():
    # Ray's memory monitor kills workers when the machine runs low on memory, whoever uses it: off here
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, namespace=NAMESPACE)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def env_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "where_env.py"
    path.write_text(ENV_SOURCE)
    return str(path)


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


@pytest.fixture
def pool(local_ray, env_path):
    with closing(EnvWorkerPool(EnvFactory(env_path), num_workers=2, capacity=8)) as pool:
        yield pool


@pytest.fixture
def gate(local_ray):
    actor = Gate.options(name=GATE, namespace=NAMESPACE).remote()
    yield actor
    ray.kill(actor)


def rows(n: int, **metadata) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"task {i}"}], "metadata": dict(metadata)} for i in range(n)]


def config(**overrides) -> EngineConfig:
    base = dict(
        n_samples_per_prompt=2, max_generating=8, max_env_steps=8, retry=RETRY,
        limits=TurnLimits(max_turns=6, max_tokens=2048), sampling=SamplingParams(max_new_tokens=8),
    )  # fmt: skip
    return EngineConfig(**{**base, **overrides})


def where(trajectory: Trajectory) -> list[tuple[int, int, int]]:
    """(pid, env identity, env step) of each turn the env answered with an observation."""
    return [found[:3] for found in steps_of(trajectory)]


def steps_of(trajectory: Trajectory) -> list[tuple[int, int, int, int]]:
    """(pid, env identity, env step, thread number) of each turn the env answered with an observation."""
    found = []
    for turn in trajectory.turns:
        if turn.observation is not None:
            text = turn.observation["content"][-1]["text"]
            pattern = r"pid=(\d+) env=(\d+) step=(\d+) thread=(\d+)"
            found.append(tuple(int(x) for x in re.fullmatch(pattern, text).groups()))
    return found


async def run_all(pool: EnvWorkerPool, encoder: ChatEncoder, source: list[dict], cfg: EngineConfig) -> list:
    async with RolloutEngine(
        backend=DeterministicBackend(), encoder=encoder, env_factory=pool, source=source, config=cfg
    ) as engine:
        return [group async for group in engine.stream()]


@pytest.mark.anyio
async def test_envs_run_in_the_workers_each_in_one_for_its_whole_trajectory(pool, encoder):
    groups = await run_all(pool, encoder, rows(4, turns=3), config())
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 8 and {t.status for t in trajectories} == {Status.COMPLETED}
    workers = set(await pool.pids())
    assert os.getpid() not in workers and len(workers) == 2
    used = set()
    for trajectory in trajectories:
        steps = where(trajectory)
        assert len(trajectory.turns) == 3 and [step for _, _, step in steps] == [1, 2]  # one env, never rebuilt
        assert len({(pid, env) for pid, env, _ in steps}) == 1, steps  # one worker, one env object
        used.add(steps[0][0])
    assert used == workers  # new envs go to the least-loaded worker: both hold some
    assert pool.statistics().num_envs == (0, 0)  # every env closed in its worker as its trajectory ended


@pytest.mark.anyio
async def test_a_worker_keeps_its_threads_from_one_call_to_the_next(local_ray, env_path, encoder):
    """A sync env's calls run in the worker's threads, kept across calls: a worker of capacity 1 steps every
    env of every trajectory on one thread. (Run from each Ray call's own task, anyio would start a thread
    for the call and end it with the call.)"""
    with closing(EnvWorkerPool(EnvFactory(env_path), num_workers=1, capacity=1)) as single:
        groups = await run_all(single, encoder, rows(3, turns=4), config())
    steps = [step for g in groups for t in g.trajectories for step in steps_of(t)]
    assert len(steps) == 3 * 2 * 3 and len({pid for pid, *_ in steps}) == 1
    assert {thread for *_, thread in steps} == {steps[0][3]}, steps


@pytest.mark.anyio
async def test_an_env_stays_in_its_worker_across_a_pause_of_partial_rollout(pool, encoder):
    backend = DeterministicBackend()
    cfg = config(n_samples_per_prompt=1, partial_rollout=True, over_sampling=4.0)
    await pool.pids()  # both workers up: no trajectory waits for its worker to start
    source = rows(4, turns=5)
    source[0]["metadata"]["turns"] = 1  # done first, while the others are mid-way
    async with RolloutEngine(backend=backend, encoder=encoder, env_factory=pool, source=source, config=cfg) as engine:
        first = await engine.rollout(1)
        await engine.wait_until_parked()
        paused = [t for g in engine.open_groups for t in g.trajectories if t.status is Status.PAUSED and t.turns]
        assert paused, "no trajectory was paused mid-way"
        held = sum(pool.statistics().num_envs)
        assert held >= len(paused)  # their envs live on in the workers while paused
        backend.version = "v1"
        await engine.resume("v1")
        rest = [g async for g in engine.stream()]
    across = [t for g in rest for t in g.trajectories if set(t.weight_versions) == {"v0", "v1"}]
    assert across, "no trajectory ran on both sides of the pause"
    assert all(len(where(t)) == 4 for t in across)  # its env went on counting: stepped 5 times, never rebuilt
    for trajectory in [t for g in [*first, *rest] for t in g.trajectories]:
        steps = where(trajectory)
        assert trajectory.status is Status.COMPLETED
        assert [step for _, _, step in steps] == list(range(1, len(steps) + 1))
        assert len({(pid, env) for pid, env, _ in steps}) <= 1, steps


@pytest.mark.anyio
async def test_a_worker_killed_mid_step_loses_nothing_and_is_replaced(pool, gate, encoder):
    """Every trajectory waits in its second step when worker 0 is killed. Its replay-safe envs (even groups)
    are rebuilt in a live worker, replayed and complete; its other envs' trajectories fail with
    env_worker_lost; the other worker's complete; each trajectory ends once, in one status."""
    source = [
        {"prompt": [{"role": "user", "content": f"task {i}"}], "metadata": {"turns": 3, "gated": [2]}} for i in range(4)
    ]
    for i, row in enumerate(source):
        row["metadata"]["replay_safe"] = i % 2 == 0
    victim = pool.workers[0]
    victim_pid = await victim.actor.pid.remote()
    groups = []

    async def collect(engine: RolloutEngine) -> None:
        groups.extend([group async for group in engine.stream()])

    async with (
        RolloutEngine(
            backend=DeterministicBackend(), encoder=encoder, env_factory=pool, source=source, config=config()
        ) as engine,
        anyio.create_task_group() as tasks,
    ):
        tasks.start_soon(collect, engine)
        with anyio.fail_after(WAIT_S):
            arrived = await gate.wait_for.remote(8)
        ray.kill(victim.actor, no_restart=True)
        await gate.release.remote()
    trajectories = {(t.group_id, t.index): t for g in groups for t in g.trajectories}
    assert len(groups) == 4 and len(trajectories) == 8  # every trajectory returned once, its group whole
    on_victim = {key for key, pid in arrived.items() if pid == victim_pid}
    assert {key[0] % 2 for key in on_victim} == {0, 1}, "the killed worker held envs of both kinds"
    for key, trajectory in trajectories.items():
        trajectory.check_invariant()
        if key not in on_victim:
            assert trajectory.status is Status.COMPLETED and "retries" not in trajectory.metadata
        elif key[0] % 2 == 0:  # replay safe: a fresh env in a live worker, the earlier turn replayed
            assert trajectory.status is Status.COMPLETED, trajectory.errors
            assert trajectory.metadata["retries"] == {"env_worker_lost": 1}
            (first_pid, _, _), (later_pid, _, step) = where(trajectory)
            assert first_pid == victim_pid and later_pid != victim_pid and step == 2
        else:
            assert (trajectory.status, trajectory.stop_reason) == (Status.FAILED, StopReason.ENV_ERROR)
            error = trajectory.errors[-1]
            assert error.error_class is ErrorClass.ENV_WORKER_LOST and "not replay_safe" in error.message
            assert "its worker 0 was lost during step" in error.message
    assert pool.statistics().num_replaced == 1
    pids = await pool.pids()
    assert len(set(pids)) == 2 and victim_pid not in pids  # a new worker in the dead one's slot


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("failing", "message"),
    [
        ({"refuse": True}, "build_env raised KeyError('no sandbox for this task')"),
        # the first reset runs in the call that builds the env: built, it is closed in its worker all the same
        ({"reset_fails": True}, "WhereEnv.reset raised OSError('the sandbox did not come up')"),
    ],
    ids=["build-raises", "first-reset-raises"],
)
async def test_an_env_that_fails_to_start_in_a_worker_fails_its_trajectory_only(pool, encoder, failing, message):
    source = [*rows(1, turns=2), *rows(1, **failing)]
    groups = sorted(await run_all(pool, encoder, source, config()), key=lambda g: g.group_id)
    assert {t.status for t in groups[0].trajectories} == {Status.COMPLETED}
    for trajectory in groups[1].trajectories:
        assert trajectory.status is Status.FAILED and trajectory.errors[-1].error_class is ErrorClass.ENV_EXCEPTION
        assert message in trajectory.errors[-1].message
        where = trajectory.errors[-1].traceback  # from the worker's process, the env's own frames only
        raising = "in build_env" if failing.get("refuse") else "in reset"
        assert where.startswith("Traceback (most recent call last):") and raising in where, where
        assert "/engine/" not in where and "/ray/" not in where
        raised = ("KeyError: 'no sandbox for this task'", "OSError: the sandbox did not come up")
        assert where.splitlines()[-1] in raised
    assert pool.statistics().num_envs == (0, 0)  # every env placed was released, closed where it was built


def test_no_env_workers_keeps_the_envs_in_process_and_bad_pool_sizes_are_refused(env_path):
    factory = EnvFactory(env_path)
    assert hosted(factory) is factory  # the default: envs in the rollout process's threads
    for workers, capacity in ((0, 4), (2, 0)):
        with pytest.raises(ValueError, match="give at least 1 worker and 1 call each"):
            EnvWorkerPool(factory, num_workers=workers, capacity=capacity)


def test_turnstile_run_with_env_workers(local_ray, tmp_path):
    from engine.cli import main

    out = tmp_path / "out.jsonl"
    argv = ["run", "--num-prompts", "2", "--max-turns", "2", "--env-workers", "2", "--out", str(out)]
    assert main(argv) == 0
    assert len(out.read_text().splitlines()) == 2


def test_the_rollout_service_hosts_its_envs_in_workers_and_ends_them_with_itself(local_ray, env_path, tokenizer):
    """slime's path: the `turnstile:` section's env_workers; the service's envs step in the workers, and
    its shutdown ends them."""
    from bridge.service import RolloutService
    from bridge.settings import BridgeSettings
    from tests.test_bridge import DataSource

    settings = BridgeSettings(
        n_samples_per_prompt=2, target_groups=2, max_turns=4, max_tokens=512, sampling=SamplingParams(max_new_tokens=8),
        env_path=env_path, env_workers=2, env_worker_capacity=2,
    )  # fmt: skip
    service = RolloutService(settings, backend=DeterministicBackend())
    try:
        pool = service.env_factory
        assert isinstance(pool, EnvWorkerPool)
        out = service.rollout(0, 2, DataSource(n_samples=2).get_samples(2))
        assert len(out.samples) == 2 and all(len(group) == 2 for group in out.samples)
        texts = [tokenizer.decode(sample.tokens) for group in out.samples for sample in group]
        pids = {int(pid) for text in texts for pid in re.findall(r"pid=(\d+)", text)}
        assert pids and os.getpid() not in pids
    finally:
        service.shutdown()
    for worker in pool.workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.actor.pid.remote())


def test_the_env_workers_benchmark_reports_both_modes(local_ray, tmp_path):
    """benchmarks/micro/env_workers.py at a tiny size: both modes answer every step, and the report has what its
    docstring promises (turns/s, loop lag, the CPU per step of the engine and of the workers)."""
    import json

    from benchmarks.micro.env_workers import main

    argv = ["--out", str(tmp_path), "--trajectories", "4", "--turns", "4", "--inflight", "4", "--step-ms", "10"]
    main([*argv, "--workers", "1"])
    report = json.loads((tmp_path / "env_workers.json").read_text())
    for mode in ("threads", "ray"):
        entry = report[mode]
        assert entry["turns"] == 16 and entry["statuses"] == {"completed": 4}, entry
        assert entry["turns_per_s"] > 0 and entry["loop_lag"]["samples"] > 0
    # the steps burn their 10 ms in this process's threads, or in the workers' (/proc counts 10 ms ticks)
    assert report["threads"]["cpu_ms_per_step"]["engine"] >= 8
    assert report["ray"]["cpu_ms_per_step"]["workers"] >= 8
    assert set(report["targets"]) == {
        "ray_p99_lag_under_20ms", "threads_p99_lag_over_100ms", "ray_turns_per_s_at_least_1.5x"
    }  # fmt: skip


def test_the_ray_call_benchmark_reports_every_mode(local_ray, tmp_path):
    """benchmarks/micro/ray_call.py at a tiny size: each mode answers every call and reports its CPU per call."""
    import json

    from benchmarks.micro.ray_call import MODES, main

    main(["--out", str(tmp_path / "ray_call.json"), "--calls", "8", "--concurrency", "2", "--step-ms", "5"])
    report = json.loads((tmp_path / "ray_call.json").read_text())
    assert set(report["modes"]) == set(MODES)
    for mode, entry in report["modes"].items():
        assert entry["calls"] == (160 if mode == "async_noop" else 8) and entry["calls_per_s"] > 0, entry
        assert entry["caller_cpu_ms_per_call"] > 0 and entry["actor_cpu_ms_per_call"] >= 0, entry
