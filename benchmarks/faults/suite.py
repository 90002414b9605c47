"""Fault-injection suite: the long-tail workload under injected faults, one kind at a time and all together.

    python -m benchmarks.faults --out DIR [--size smoke|small|large] [--faults NAME ...] [--seed 0]
    python -m benchmarks.faults --out DIR --sglang [--size smoke|small] [--sglang-url URL] [--faults NAME ...]

Every case runs the long-tail workload (benchmarks/longtail/workload.py, the ~30 ms env, no failures of its own; a
20 ms reward function) through a fresh `RolloutEngine` with partial rollout, against the simulated SGLang
server (benchmarks/longtail/simserver.py, its own process) for the size's steps, with a weight update after each
step, as benchmarks/longtail/run.py's `turn_partial` policy does. The first case, `none`, injects nothing: it is
what every other case is compared with. Faults come from engine.envs.faults (envs and the reward function),
the simulated server's own fault injection (5xx, malformed replies), and this module (processes killed:
env processes, the server, one of two workers behind sglang-router or in a BackendPool, the rollout
service's Ray actor). Processes are killed mid-step: when the run has made a share (30% to 60%) of the
generate calls the `none` case made in all; the Ray actor is killed between steps 1 and 2, a rollout shard once
step 2 has begun on it.

The agent cases run agent programs instead of the workload's envs: agent envs (engine/agents/env.py) whose
agents (the `openai` SDK, 1 to 6 requests each, in a process of their own: benchmarks/agents/farm.py) talk to
the engine's session gateway, their rewards their own. `agents_none` injects nothing and is what they are
compared with; the others inject agent crashes, agents that stop asking (until their deadline,
AGENT_DEADLINE_S), malformed requests before real ones (each must be refused with a 4xx, else its agent
crashes), and streams left after their first chunk and sent again. Their entries' `injected` holds the
agents' own counts, the gateway's (bad requests, disconnects, forks, agent exits by outcome) and why agents
crashed.

DIR/report.json has one entry per case (see `summarize` in cases.py):
  prompts        taken from the source, returned in a group, held at the end (paused, or done and not yet
                 returned), dropped by a filter, lost (taken and none of those: must be 0), returned twice
  trajectories   returned, by status, by stop reason; failed ones by the error class that ended them
  retries        spent, by class (the engine's counts; and in returned trajectories, metadata["retries"]);
                 budgets exhausted, by class; the budget (per turn by class, per trajectory); the most one
                 trajectory spent
  throughput     trained tokens (loss mask 1 of returned trajectories that did not fail) per second of the
                 case's steps, and against `none`
  steps          seconds of each rollout step; p50 and mean, and their inflation against `none`
  injected       what was injected (env faults by kind, reward faults, server faults, kills)
  engine_failure None, or what went wrong in the engine: `crash` (an exception out of the engine, with the
                 head of its traceback), `hang` (a step or a pause past its limit, with the engine's phases),
                 `step_error` (an exception out of rollout/pause/resume)
DIR/report.md has the table printed at the end; DIR/faults.png the throughput and step-time figures.

`--sglang` runs the same cases against real SGLang 0.5.23 servers on CPU instead (benchmarks/faults/sglang.py:
the tiny random-weight Qwen2.5-VL model of tests/sglang_cpu/server.py). The engine-side cases are unchanged;
5xx and malformed replies are injected into the real server's replies by benchmarks/faults/proxy.py in front of
it; the restart is a real SGLang restart on its port; a two-server case runs on the suite's server and a second
one started beside it (the one killed). What was injected is counted by the proxy; each case starts with a real
weight reload to version v0, and each step ends with one to the step's version. The workload is sized down
(SGLANG_SIZES, default `small`: 2 groups of 2 samples, 3 steps, 16 tokens a turn): the random model seldom emits
its stop token, so nearly every turn runs to its cap of max_new_tokens, and a turn costs about a second of CPU
decoding; the turns are not the simulated workload's, and throughput compares with `none` of the same run only.
SGLANG_COVERS and SGLANG_DIFFERS (also in the report) say what it covers and what it does not. report.json's
top-level "server" says which server a report is of ("simulated" or "sglang").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio
import httpx2

from benchmarks.agents.farm import AgentFarm, FarmAgent
from benchmarks.faults.cases import (
    AGENT_DEADLINE_S,
    AGENT_PLAN,
    BY_NAME,
    CASE_NAMES,
    CASES,
    FAULT_STEP,
    HANG_S,
    HEADER,
    KILL_FROM,
    KILL_TO,
    STEP_TIMEOUT_S,
    Case,
    CaseRun,
    engine_figures,
    failure_record,
    line,
    outcome_of,
    summarize,
)
from benchmarks.faults.servers import (
    ProcessUnavailable,
    RouterProcess,
    ServerFront,
    Servers,
    SimServers,
    router_available,
)
from benchmarks.longtail.common import RewardLog, RewardModel
from benchmarks.longtail.run import HEADLINE, Size, sized
from benchmarks.longtail.workload import Workload
from engine.agents.env import AgentHost
from engine.backends.base import SamplingParams
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend
from engine.config import EngineConfig
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import EnvRunner
from engine.envs.faults import FaultLog, FaultyReward, SubprocessEnv, inject, release_hangs
from engine.envs.loader import EnvSample
from engine.scheduler.retry import RetryPolicy
from engine.turn import TurnLimits

SGLANG_COVERS = (
    "--sglang runs every case against real SGLang 0.5.23 servers on CPU (tests/sglang_cpu/server.py: the tiny "
    "random-weight Qwen2.5-VL model): the env, reward, env-process and Ray-actor cases unchanged, against one "
    "server; 5xx and malformed replies injected into the real server's replies by a proxy in front of it "
    "(benchmarks/faults/proxy.py); the server SIGKILLed mid-step and a new one started on its port (a real restart); "
    "a second real server, behind real sglang-router or in a BackendPool, SIGKILLed for good. Each case starts at "
    "weight version v0 and each step ends with a real weight update (slime's calls: pause, flush, "
    "/update_weights_from_disk of the model's own directory, continue); "
    "what was injected is counted by the proxy, not read from the server."
)
SGLANG_DIFFERS = (
    "What differs from the simulated run: the workload is smaller (SGLANG_SIZES: few groups, 2 samples each, "
    "turns capped at 8 or 16 tokens), and its turns are not the workload's: the random model seldom emits its stop "
    "token, so nearly every turn runs to its cap; throughput and step times are those of a tiny model on a "
    "2-core CPU, and a restart costs an SGLang start (tens of seconds), not the simulator's second. Not covered: a "
    "GPU server and a model that stops by itself, faults inside SGLang that leave its process alive (out of "
    "memory, a stuck scheduler), and a weight update that fails or changes the weights (the same directory is "
    "reloaded)."
)


def _sizes() -> dict[str, Size]:
    return {
        "smoke": sized("small", target_groups=2, num_steps=3, server={"max_running": 8}),
        "small": sized("small"),
        "large": sized("large"),
    }


SIZES = _sizes()
# The real SGLang CPU server (--sglang): a turn of the random model runs to max_new_tokens at roughly 10 decode
# steps a second, so fewer and shorter turns; `server.max_running` caps the engine's concurrent generate calls.
SGLANG_SIZES = {
    "smoke": sized("small", target_groups=2, num_steps=2, n_samples=2, max_new_tokens=8, max_tokens=1024,
                   server={"max_running": 8}),
    "small": sized("small", target_groups=2, num_steps=3, n_samples=2, max_new_tokens=16, max_tokens=1024,
                   server={"max_running": 8}),
}  # fmt: skip


# -- the engine's surroundings -------------------------------------------------------------------------------


class CountingSource:
    """The workload's prompts, in order, noting which were taken."""

    def __init__(self, workload: Workload):
        self.workload, self.taken = workload, []

    def take(self, n: int) -> list[dict[str, Any]]:
        rows = self.workload.rows(n, start=len(self.taken))
        self.taken += [row["metadata"]["prompt_id"] for row in rows]
        return rows


class CallTriggers:
    """A backend that counts generate calls (per step, and in all) and sets an event once so many were made."""

    def __init__(self, backend: Any):
        self.inner, self.step, self.calls, self.total = backend, 0, Counter(), 0
        self._triggers: list[tuple[int, anyio.Event]] = []

    def at(self, calls: int) -> anyio.Event:
        """An event set when the `calls`-th generate call is made (that is, during a step)."""
        event = anyio.Event()
        self._triggers.append((max(1, calls), event))
        return event

    async def generate(self, input_ids, sampling_params, image_data=None, **options):
        self.calls[self.step] += 1
        self.total += 1
        for calls, event in self._triggers:
            if self.total >= calls:
                event.set()
        return await self.inner.generate(input_ids, sampling_params, image_data, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# -- the suite ---------------------------------------------------------------------------------------------


class Suite:
    """The cases, run one after another against `servers` (default: simulated ones, configured by the size)."""

    def __init__(
        self,
        size: Size,
        *,
        seed: int = 0,
        log: Callable[[str], None] = print,
        workdir: Path | None = None,
        servers: Servers | None = None,
    ):
        from engine.models import load_tokenizer

        self.size, self.seed, self.log = size, seed, log
        self.workdir = workdir
        self.servers: Servers = servers or SimServers(size.server)
        self.primary_start_s = 0.0  # how long the suite's server took to start
        self.encoder = ChatEncoder(load_tokenizer("qwen2.5"))
        self.sampling = SamplingParams(max_new_tokens=size.max_new_tokens, stop_token_ids=self.encoder.stop_token_ids)
        self.workload = Workload(
            HEADLINE, env_median_s=size.env_medians[HEADLINE], seed=seed, failure_rate=0.0,
            reward_source=size.reward_source, reward_latency_s=size.reward_latency_s,
        )  # fmt: skip
        self.limits = TurnLimits(max_turns=self.workload.max_turns, max_tokens=size.max_tokens)
        self.retry = RetryPolicy(env_step_timeout_s=STEP_TIMEOUT_S)
        self.baselines: dict[str, CaseRun] = {}  # the runs of `none` (envs) and `agents_none` (agents), by name
        self.primary: Any = None

    def baseline(self, case: Case | None) -> CaseRun | None:
        """What `case` is compared with: `none`, or for an agent case `agents_none`."""
        return self.baselines.get("agents_none" if case is not None and case.agents is not None else "none")

    def config(self, case: Case | None = None) -> EngineConfig:
        """The engine's settings; for an agent case, staleness bounded at 3 versions (sessions run for several
        steps: past the bound they end STALE, and the long-tail env's bound of 1 would end most)."""
        s = self.size
        return EngineConfig(
            n_samples_per_prompt=s.n_samples, max_inflight=math.ceil(s.target_groups * s.over_sampling) * s.n_samples,
            max_generating=s.server.max_running, max_env_steps=s.max_env_steps, policy=s.scheduling,
            partial_rollout=True, over_sampling=s.over_sampling, in_flight="fixed", on_stale="restart",
            max_staleness=3 if case is not None and case.agents is not None else 1,
            limits=self.limits, sampling=self.sampling, retry=self.retry, seed=self.seed,
        )  # fmt: skip

    def step_limit_s(self, case: Case | None = None) -> float:
        """A step past this is a hang: 10 x the baseline's slowest step, at least the servers' `min_step_limit_s`
        (60 s simulated, longer on a CPU SGLang server); for a case that restarts the server, plus three times what
        the suite's server took to start (a real SGLang start is long)."""
        baseline = self.baseline(case)
        slowest = max(baseline.step_seconds, default=0.0) if baseline else 0.0
        restart = 3 * self.primary_start_s if case is not None and case.restart_server else 0.0
        return max(self.servers.min_step_limit_s, 10 * slowest) + restart

    def trigger_calls(self, share: float) -> int:
        """The generate call at which a kill happens: `share` of the calls the `none` case made in all (a
        step's own count depends on what the step before left paused; the run's does not much)."""
        baseline = self.baseline(None)
        made = sum(baseline.calls_per_step) if baseline and baseline.calls_per_step else 60
        return max(2, round(share * made))

    async def run(
        self, cases: Sequence[Case], results: dict[str, Any], on_case: Callable[[], None] = lambda: None
    ) -> None:
        """Each case in turn, its entry into `results`, then `on_case()`. A case the suite itself cannot run (its
        processes do not start, an import fails) gets an entry saying so, and the suite goes on."""
        self.primary = self.servers.primary(self._log_path(self.servers.kind))
        begun = time.monotonic()
        await anyio.to_thread.run_sync(self.primary.start)
        self.primary_start_s = time.monotonic() - begun
        try:
            for case in cases:
                started = time.monotonic()
                try:
                    run = await self.run_case(case)
                except Exception as exc:  # noqa: BLE001 -- the suite's own failure: reported, the next case runs
                    results[case.name] = {"what": case.what, "suite_error": failure_record("suite_error", exc)}
                    if not self.primary.is_running:
                        await anyio.to_thread.run_sync(self.primary.start)
                else:
                    if case.name in ("none", "agents_none"):
                        self.baselines[case.name] = run
                    results[case.name] = summarize(case, run, self.baseline(case), self.retry)
                results[case.name]["case_seconds"] = round(time.monotonic() - started, 2)
                self.log(line(case.name, results[case.name]))
                on_case()
        finally:
            await anyio.to_thread.run_sync(self.primary.stop)
            for env in SubprocessEnv.live():
                env.close()
            release_hangs()

    def _log_path(self, name: str) -> Path | None:
        return None if self.workdir is None else self.workdir / "logs" / f"{name}.log"

    async def run_case(self, case: Case) -> CaseRun:
        if case.ray:
            from benchmarks.faults.ray_case import run_ray_case

            return await run_ray_case(self, case)
        if case.restart_server and (reason := self.servers.cannot_kill(self.primary)) is not None:
            return CaseRun(case.name, skipped=reason)
        if case.topology == "single":
            return await self._run_on([self.primary], case)
        if case.topology == "router" and (reason := router_available()) is not None:
            return CaseRun(case.name, skipped=reason)
        reuse = [self.primary] if self.servers.reuses_primary else []
        fresh = [self.servers.new(self._log_path(f"{case.name}-{i}")) for i in range(2 - len(reuse))]
        servers = reuse + fresh
        try:
            for server in fresh:
                begun = time.monotonic()
                try:
                    await anyio.to_thread.run_sync(server.start)
                except ProcessUnavailable as exc:
                    if not reuse:
                        raise
                    waited = time.monotonic() - begun
                    why = f"a second {self.servers.kind} server did not start beside the first ({waited:.0f} s): {exc}"
                    return CaseRun(case.name, skipped=why)
            if case.topology == "pool":
                return await self._run_on(servers, case)
            router = RouterProcess(
                [s.url for s in servers], health_timeout_s=self.servers.health_timeout_s,
                log_path=self._log_path(f"{case.name}-router"),
            )  # fmt: skip
            try:
                await anyio.to_thread.run_sync(router.start)
            except ProcessUnavailable as exc:
                return CaseRun(case.name, skipped=f"sglang-router did not start in front of the servers: {exc}")
            try:
                return await self._run_on(servers, case, url=router.url)
            finally:
                await anyio.to_thread.run_sync(router.stop)
        finally:
            for server in fresh:
                await anyio.to_thread.run_sync(server.stop)

    async def _run_on(self, servers: list[Any], case: Case, *, url: str | None = None) -> CaseRun:
        """The case on `servers` (the first one injecting the case's server faults), through `url` when given (a
        router in front of them), else through each server's own URL."""
        run = CaseRun(case.name)
        for server in servers:
            await self.servers.reset(server, seed=self.seed)
        async with self.servers.front(servers[0], case.server_faults, seed=self.seed) as front:
            await self._run_through(front, servers, case, run, url=url)
        for env in SubprocessEnv.live():  # children of envs the engine did not get to close (a crash)
            env.close()
        return run

    async def _run_through(
        self, front: ServerFront, servers: list[Any], case: Case, run: CaseRun, *, url: str | None
    ) -> None:
        env_log, reward_log = FaultLog(), RewardLog()
        reward = RewardModel(self.workload, self.encoder, reward_log) if self.workload.reward_source == "rm" else None
        if reward is not None and case.reward_error_rate:
            reward = FaultyReward(reward, case.reward_error_rate, seed=self.seed)
        source = CountingSource(self.workload)
        if url is None:
            clients = [SGLangBackend(u, timeout=120.0) for u in [front.url, *(s.url for s in servers[1:])]]
        else:
            clients = [SGLangBackend(url)]
        async with contextlib.AsyncExitStack() as stack:
            for client in clients:
                await stack.enter_async_context(client)
            backend = CallTriggers(clients[0] if len(clients) == 1 else BackendPool(clients, cooldown_s=2.0))
            if case.agents is None:
                factory = self._env_factory(case, env_log)
            else:  # the agents report their rewards (info["reward"]): no reward function
                farm = await stack.enter_async_context(AgentFarm(AGENT_PLAN, case.agents))
                factory, reward = self._agent_factory(farm), None
            engine = RolloutEngine(
                backend=backend, encoder=self.encoder, env_factory=factory, source=source,
                config=self.config(case), reward_fn=reward,
            )  # fmt: skip
            await self._drive(case, run, engine, backend, servers)
            if case.agents is not None:
                run.injected["agents"] = dict(sorted(farm.counts.items()))
                run.injected["agent_errors"] = dict(farm.errors.most_common(10))
                counted = ("bad_requests:", "disconnects", "forks:", "agent_exits:")
                gateway = AgentHost.of(engine.env_host).gateway.counts
                run.injected["gateway"] = {k: v for k, v in sorted(gateway.items()) if k.startswith(counted)}
        run.taken = list(source.taken)
        run.injected["env"] = env_log.snapshot()["injected"]
        run.injected["env_calls"] = env_log.snapshot()["calls"]
        if isinstance(reward, FaultyReward):
            run.injected["reward"] = {"calls": reward.calls, "raised": reward.injected}
        if servers[0].is_running:
            with contextlib.suppress(httpx2.HTTPError):
                run.injected["server"] = await front.counts()

    @staticmethod
    def _agent_factory(farm: AgentFarm) -> Callable[[EnvSample], EnvRunner]:
        def factory(sample: EnvSample) -> EnvRunner:
            seed = sample.metadata["prompt_id"] * 1_000 + sample.index
            return EnvRunner(FarmAgent(seed, farm, timeout_s=AGENT_DEADLINE_S))

        return factory

    def _env_factory(self, case: Case, log: FaultLog) -> Callable[[EnvSample], EnvRunner]:
        workload, spec = self.workload, case.env
        if spec is not None:
            spec = spec.model_copy(update={"seed": self.seed})

        def factory(sample: EnvSample) -> EnvRunner:
            key = f"{sample.metadata['prompt_id']}/{sample.index}"
            if case.subprocess_envs:
                build = functools.partial(workload.build_env, {"metadata": dict(sample.metadata)})
                env: Any = SubprocessEnv(build, replay_safe=case.replay_safe_envs, key=key, start=True)
            else:
                env = workload.build_env(sample)
            if spec is not None:
                env = inject(env, spec, key=key, log=log)
            return EnvRunner(env, step_timeout=STEP_TIMEOUT_S)

        factory.blocking = case.subprocess_envs  # the engine builds the env in a worker thread: a child starts
        return factory

    async def _drive(
        self, case: Case, run: CaseRun, engine: RolloutEngine, backend: CallTriggers, servers: list[Any]
    ) -> None:
        """The steps, with the case's faults happening alongside; every failure of the engine is recorded."""
        size = self.size
        ready = anyio.Event()  # set when no server is being restarted
        ready.set()
        state = {"version": "v0", "ready": ready}
        try:
            async with engine, anyio.create_task_group() as actions:
                actions.start_soon(self._actions, case, run, backend, servers, state)
                started = time.monotonic()
                for step in range(size.num_steps):
                    backend.step = step
                    begun = time.monotonic()
                    try:
                        with anyio.fail_after(self.step_limit_s(case)):
                            groups = await engine.rollout(size.target_groups)
                        trains = True
                    except TimeoutError:
                        run.failure = failure_record(
                            "hang", None, step=step, where="rollout", engine=engine_figures(engine)
                        )
                        break
                    except Exception as exc:  # noqa: BLE001 -- recorded: the report says what the engine raised
                        groups = getattr(exc, "groups", None)
                        if not isinstance(groups, list):
                            run.failure = failure_record("step_error", exc, step=step, where="rollout")
                            break
                        # a step refused for its share of failures: its groups come back on the error
                        run.steps_refused.append({"step": step, "error": f"{type(exc).__name__}: {exc}"})
                        trains = False
                    run.step_seconds.append(time.monotonic() - begun)
                    run.calls_per_step.append(backend.calls[step])
                    run.returned.append(
                        [outcome_of(t, g.row["metadata"]["prompt_id"], trains) for g in groups for t in g.trajectories]
                    )
                    run.returned_prompts += [g.row["metadata"]["prompt_id"] for g in groups]
                    if not await self._between_steps(case, run, engine, servers, state, step):
                        break
                run.wall_seconds = time.monotonic() - started
                await self._hold(run, engine)
                actions.cancel_scope.cancel()
        except Exception as exc:  # noqa: BLE001 -- a crash of the engine: recorded, the suite goes on
            if run.failure is None:
                run.failure = failure_record("crash", exc)
            run.wall_seconds = run.wall_seconds or sum(run.step_seconds)
        if run.failure is not None and run.failure["kind"] == "crash":
            run.held_prompts = []  # the engine is gone, and what it held with it

    async def _between_steps(
        self, case: Case, run: CaseRun, engine: RolloutEngine, servers: list[Any], state: dict[str, Any], step: int
    ) -> bool:
        """Pause, update the weights of every live server, resume; False (and a failure recorded) if that fails."""
        version = f"v{step + 1}"
        try:
            with anyio.fail_after(self.step_limit_s(case)):
                await engine.pause()
                await state["ready"].wait()  # a server being restarted comes back first
                for server in servers:
                    if server.is_running:
                        await self.servers.update_weights(server, version)
                state["version"] = version
                if step + 1 < self.size.num_steps:
                    await engine.resume(version)
        except TimeoutError:
            run.failure = failure_record("hang", None, step=step, where="pause", engine=engine_figures(engine))
            return False
        except Exception as exc:  # noqa: BLE001
            run.failure = failure_record("step_error", exc, step=step, where="pause/resume")
            return False
        return True

    async def _hold(self, run: CaseRun, engine: RolloutEngine) -> None:
        """After the last step: paused, every unfinished trajectory parked; note what the engine holds."""
        try:
            with anyio.fail_after(self.step_limit_s()):
                await engine.pause()
                await engine.wait_until_parked()
        except TimeoutError:
            if run.failure is None:
                run.failure = failure_record("hang", None, step=len(run.step_seconds), where="wait_until_parked",
                                             engine=engine_figures(engine))  # fmt: skip
        run.held_prompts = [g.row["metadata"]["prompt_id"] for g in engine.held_groups]
        run.dropped = sum(engine.statistics().num_groups_dropped.values())
        run.engine = engine_figures(engine)

    async def _actions(
        self, case: Case, run: CaseRun, backend: CallTriggers, servers: list[Any], state: dict[str, Any]
    ) -> None:
        """The kills of this case, at their moments. A kill that cannot be done is noted."""
        try:
            async with anyio.create_task_group() as tg:
                if case.kill_envs:
                    tg.start_soon(self._kill_envs, case, run, backend)
                if case.restart_server:
                    tg.start_soon(self._restart_server, case, run, backend, servers[0], state)
                if case.kill_worker:
                    tg.start_soon(self._kill_worker, run, backend, servers[1])
        except Exception as exc:  # noqa: BLE001 -- the suite's own trouble, noted; the case goes on
            run.notes.append(f"a fault action failed: {exc!r}")

    async def _kill_envs(self, case: Case, run: CaseRun, backend: CallTriggers) -> None:
        rng = random.Random(self.seed)
        for k in range(case.kill_envs):
            at = self.trigger_calls(KILL_FROM + (KILL_TO - KILL_FROM) * k / max(1, case.kill_envs - 1))
            await backend.at(at).wait()
            live = sorted(SubprocessEnv.live(), key=lambda e: str(e.key))
            if not live:
                run.actions.append({"action": "kill env process", "at_call": at, "done": False, "why": "none alive"})
                continue
            victim = rng.choice(live)
            pid = victim.pid
            victim.kill()
            run.actions.append({"action": "kill env process", "at_call": at, "env": victim.key, "pid": pid})

    async def _restart_server(
        self, case: Case, run: CaseRun, backend: CallTriggers, server: Any, state: dict[str, Any]
    ) -> None:
        """At its moment, the server killed and started again on its port; between steps, the suite waits for it."""
        at = self.trigger_calls(KILL_FROM)
        await backend.at(at).wait()
        state["ready"] = anyio.Event()
        killed = time.monotonic()
        try:
            before = await self.servers.restart(
                server, faults=dict(case.server_faults), version=state["version"], seed=self.seed
            )
        finally:
            state["ready"].set()  # back, or the failure noted by _actions: the steps go on either way
        if before:  # what the killed server had injected (a simulated server's counts die with it)
            run.injected.setdefault("server_before_restart", before)
        down = time.monotonic() - killed
        run.actions.append({"action": "kill and restart the server", "at_call": at, "down_s": round(down, 3)})

    async def _kill_worker(self, run: CaseRun, backend: CallTriggers, server: Any) -> None:
        at = self.trigger_calls(KILL_FROM)
        await backend.at(at).wait()
        await anyio.to_thread.run_sync(server.kill)
        run.actions.append({"action": "kill one of two servers for good", "at_call": at, "server": server.url})


# -- the run: every case, the report, the command ------------------------------------------------------------


async def run_suite(
    size: Size,
    cases: Sequence[Case],
    *,
    seed: int = 0,
    log: Callable[[str], None] = print,
    workdir: Path | None = None,
    on_case: Callable[[dict[str, Any]], None] = lambda report: None,
    servers: Servers | None = None,
) -> dict[str, Any]:
    """The report as a dict: one entry per case under "faults" (`none` first, always), the config, the notes;
    `on_case(report)` after each case, with the entries so far. `servers`: default simulated ones."""
    names = [c.name for c in cases]
    if "none" not in names:
        cases = [CASES[0], *cases]
    if any(c.agents is not None for c in cases) and "agents_none" not in names:  # first of the agent cases
        at = next(i for i, c in enumerate(cases) if c.agents is not None)
        cases = [*cases[:at], BY_NAME["agents_none"], *cases[at:]]
    suite = Suite(size, seed=seed, log=log, workdir=workdir, servers=servers)
    report: dict[str, Any] = {
        "server": suite.servers.kind,
        "faults": {},
        "config": {
            "seed": seed, "size": asdict(size), "step_timeout_s": STEP_TIMEOUT_S, "hang_s": HANG_S,
            "ray_actor_killed_after_step": FAULT_STEP, "kills_between_call_shares": [KILL_FROM, KILL_TO],
            "workload": asdict(suite.workload), "retry": json.loads(suite.retry.model_dump_json()),
        },
        "sglang": sglang_note(suite.servers.kind == "sglang"),
    }  # fmt: skip
    log(HEADER)
    await suite.run(cases, report["faults"], lambda: on_case(report))
    report["config"]["server_start_s"] = round(suite.primary_start_s, 1)
    return report


def sglang_note(run: bool) -> dict[str, Any]:
    """The report's "sglang" entry: whether this run was against real SGLang, what that covers and what not."""
    if run:
        return {"run": True, "covers": SGLANG_COVERS, "differs": SGLANG_DIFFERS}
    return {"run": False, "why": f"this run is against the simulated server. {SGLANG_COVERS} {SGLANG_DIFFERS}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("faults-report"))
    parser.add_argument("--size", choices=list(SIZES), default="small",
                        help=f"with --sglang: {' or '.join(SGLANG_SIZES)} (SGLANG_SIZES)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", nargs="+", choices=CASE_NAMES, help="cases to run (default: all); none always")
    parser.add_argument("--sglang", action="store_true", help="against real SGLang CPU servers (tests/sglang_cpu)")
    parser.add_argument("--sglang-url", metavar="URL", help="with --sglang: a running SGLang server to use (the "
                        "cases that kill it are skipped)")  # fmt: skip
    args = parser.parse_args(argv)
    servers: Servers | None = None
    sizes = SIZES
    if args.sglang_url and not args.sglang:
        parser.error("--sglang-url is read with --sglang only")
    if args.sglang:
        from benchmarks.faults.sglang import SGLangServers, unavailable

        if args.size not in SGLANG_SIZES:
            parser.error(f"--size {args.size} is not sized for the SGLang CPU server; with --sglang choose "
                         f"{' or '.join(SGLANG_SIZES)}")  # fmt: skip
        if (reason := unavailable()) is not None:
            parser.error(f"--sglang: {reason}")
        servers, sizes = SGLangServers(url=args.sglang_url), SGLANG_SIZES
    cases = [c for c in CASES if args.faults is None or c.name in args.faults]
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)

    def save(report: dict[str, Any], *, final: bool = False) -> None:
        report["size"] = args.size
        report["total_seconds"] = round(time.monotonic() - started, 1)
        report["complete"] = final
        write_outputs(report, args.out, plot=final)

    size = sizes[args.size]
    try:
        report = anyio.run(
            lambda: run_suite(size, cases, seed=args.seed, workdir=args.out, on_case=save, servers=servers)
        )
    except ProcessUnavailable as exc:  # the suite's own server did not come up: nothing was run
        print(f"faults: error: the suite's server did not start: {exc}", file=sys.stderr)
        return 1
    save(report, final=True)
    print(f"wrote {args.out}/report.json, report.md, faults.png in {report['total_seconds']:.0f}s")
    return 0


def write_outputs(report: dict[str, Any], out: Path, *, plot: bool = True) -> None:
    """report.json and report.md (after every case, so an interrupted run keeps what it measured); faults.png."""
    from benchmarks.faults.report import plot as plot_figure
    from benchmarks.faults.report import write_markdown

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_markdown(report, out / "report.md")
    if plot:
        plot_figure(report, out / "faults.png")


if __name__ == "__main__":
    sys.exit(main())
