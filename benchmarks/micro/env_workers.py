"""CPU-bound envs: stepped in threads of the rollout process, against stepped in Ray env workers.

    python -m benchmarks.micro env_workers --out DIR [--trajectories 64] [--turns 8] [--inflight 32]
                                     [--step-ms 10] [--workers 2] [--capacity 1] [--repeats 1]

Every env step burns `--step-ms` of CPU in pure Python (measured on its thread's CPU clock, so a step
costs the same CPU however busy the machine is). Generation is free: the backend and the encoder of
benchmarks/micro/overhead.py answer at once, so the env is the only work. Two modes, the same engine
settings: `threads`, the default, where sync env steps run in the rollout process's threads (under
its one GIL, beside the engine's event loop); `ray`, where they run in `--workers` env workers
(engine/envs/ray_workers.py) on a local Ray with this machine's cores, each running `--capacity` steps
at once (pure-Python steps share a worker's GIL, so one or two per worker keep its event loop, which
answers the engine, from waiting behind them). Ray's workers run at the rollout process's priority
here (Ray's default is nice 15, which on a busy machine starves them).

For each mode: turns per second (env steps answered, per second of wall time, workers' start-up not
counted) and the engine loop's lag: a timer task in the engine's loop sleeps 10 ms at a time and
records how late it wakes (p50, p99, max, ms); and the CPU per env step (`cpu_ms_per_step`) of this process
(the engine, and in `threads` mode the steps too) and of the env workers' processes (the steps, and each
call's way through Ray and the worker), from /proc. Targets: with Ray workers the p99 lag stays under 20 ms
where threads push it past 100 ms, and turns per second are at least 1.5x the threads'. The report
goes to DIR/env_workers.json, with the machine's core count and load average: on a machine shared
with other work, the figures move with that load.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

from benchmarks import emit
from benchmarks.micro.overhead import FixedEncoder, InstantBackend
from engine.backends.base import SamplingParams
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import BaseInteractionEnv
from engine.envs.loader import EnvFactory
from engine.turn import TurnLimits

TICK_S = 0.010  # the lag probe's sleep
ENV_MODULE = "benchmarks.micro.env_workers"  # this module: its build_env is what the workers load


class CpuEnv(BaseInteractionEnv):
    """Done after `turns` steps; each step burns `step_ms` of this thread's CPU time in Python."""

    def __init__(self, turns: int, step_ms: float):
        self.turns, self.step_s, self.steps = turns, step_ms / 1000.0, 0

    def reset(self):
        self.steps = 0
        return {}, {}

    def step(self, response_text: str):
        burn(self.step_s)
        self.steps += 1
        done = self.steps >= self.turns
        return {"obs_str": "next"}, done, {"reward": 1.0} if done else {}

    def format_observation(self, observation):
        return {"role": "user", "content": observation["obs_str"]}


def burn(seconds: float) -> int:
    """Pure-Python arithmetic until this thread has used `seconds` of CPU."""
    end, x = time.thread_time() + seconds, 1
    while time.thread_time() < end:
        for i in range(200):
            x = (x * 31 + i) % 1_000_003
    return x


def build_env(sample=None, args=None, **kw) -> CpuEnv:
    return CpuEnv(args.turns, args.step_ms)


class LagProbe:
    """Sleeps TICK_S at a time in the engine's loop and keeps how late each wake-up came, in seconds."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await anyio.sleep(TICK_S)
            self.lags.append(max(0.0, time.perf_counter() - started - TICK_S))

    def summary(self) -> dict[str, float]:
        lags = sorted(self.lags) or [0.0]
        at = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))]  # noqa: E731
        return {
            "p50_ms": round(at(0.50) * 1000, 2),
            "p99_ms": round(at(0.99) * 1000, 2),
            "max_ms": round(lags[-1] * 1000, 2),
            "samples": len(self.lags),
        }


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_mode(env_factory: Any, args: argparse.Namespace, worker_pids: list[int] = ()) -> dict[str, Any]:
    """One pass of `--trajectories` trajectories through an engine with `env_factory`; with the CPU it took,
    per env step, in this process and in the processes of `worker_pids`."""
    rows = [{"prompt": [{"role": "user", "content": "q"}]} for _ in range(args.trajectories)]
    config = EngineConfig(
        max_inflight=args.inflight, max_generating=args.inflight, max_env_steps=args.inflight,
        limits=TurnLimits(max_turns=args.turns, max_tokens=100_000), sampling=SamplingParams(max_new_tokens=16),
    )  # fmt: skip
    probe = LagProbe()
    engine = RolloutEngine(
        backend=InstantBackend(), encoder=FixedEncoder(), env_factory=env_factory, source=rows, config=config
    )
    statuses: dict[str, int] = {}
    num_turns = 0
    engine_cpu, workers_cpu = time.process_time(), sum(map(process_cpu_s, worker_pids))
    started = time.perf_counter()
    async with engine, anyio.create_task_group() as probing:
        probing.start_soon(probe.run)
        async for group in engine.stream():
            for trajectory in group.trajectories:
                num_turns += len(trajectory.turns)
                statuses[str(trajectory.status)] = statuses.get(str(trajectory.status), 0) + 1
        seconds = time.perf_counter() - started
        probing.cancel_scope.cancel()
    engine_cpu, workers_cpu = time.process_time() - engine_cpu, sum(map(process_cpu_s, worker_pids)) - workers_cpu
    return {
        "turns": num_turns,
        "seconds": round(seconds, 3),
        "turns_per_s": round(num_turns / seconds, 1),
        # this process (the engine, and in `threads` mode the steps) and the env workers, per env step
        "cpu_ms_per_step": {
            "engine": round(engine_cpu / num_turns * 1000, 2),
            "workers": round(workers_cpu / num_turns * 1000, 2),
        },
        "loop_lag": probe.summary(),
        "statuses": statuses,
    }


async def threads_mode(factory: EnvFactory, args: argparse.Namespace) -> dict[str, Any]:
    return {"mode": "threads", "env_threads": args.inflight, **await run_mode(factory, args)}


async def ray_mode(factory: EnvFactory, args: argparse.Namespace, pool: Any) -> dict[str, Any]:
    pids = await pool.pids()
    return {"mode": "ray", "workers": args.workers, "capacity": args.capacity, **await run_mode(pool, args, pids)}


async def start_pool(factory: EnvFactory, args: argparse.Namespace) -> tuple[Any, float]:
    """A pool with every worker up, and the seconds that took (Ray's own start included)."""
    import ray

    from engine.envs.ray_workers import EnvWorkerPool

    started = time.perf_counter()
    if not ray.is_initialized():
        # Ray starts its workers at nice 15, the rollout process runs at 0: the same priority for both
        # modes. Ray's memory monitor kills workers when the machine runs low on memory, whoever uses it.
        os.environ.setdefault("RAY_worker_niceness", "0")
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    pool = EnvWorkerPool(factory, num_workers=args.workers, capacity=args.capacity)
    await pool.pids()
    return pool, round(time.perf_counter() - started, 2)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median turns per second, with every run's figure beside it."""
    ranked = sorted(runs, key=lambda r: r["turns_per_s"])
    return {**ranked[len(ranked) // 2], "turns_per_s_each": [r["turns_per_s"] for r in runs]}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    factory = EnvFactory(ENV_MODULE, SimpleNamespace(turns=args.turns, step_ms=args.step_ms))
    pool, start_s = await start_pool(factory, args)
    try:
        threads_runs, ray_runs = [], []
        for _ in range(args.repeats):  # interleaved, so both modes see the same load on the machine
            threads_runs.append(await threads_mode(factory, args))
            ray_runs.append(await ray_mode(factory, args, pool))
    finally:
        pool.close()
    threads, ray_ = median_run(threads_runs), median_run(ray_runs)
    speedup = ray_["turns_per_s"] / threads["turns_per_s"]  # the target is checked unrounded
    return {
        "benchmark": "env_workers",
        "machine": {"cpus": os.cpu_count(), "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]},
        "workload": {
            "trajectories": args.trajectories,
            "turns_each": args.turns,
            "step_cpu_ms": args.step_ms,
            "inflight": args.inflight,
            "repeats": args.repeats,
        },
        "threads": threads,
        "ray": {**ray_, "workers_start_s": start_s},
        "ray_over_threads_turns_per_s": round(speedup, 3),
        "targets": {
            "ray_p99_lag_under_20ms": ray_["loop_lag"]["p99_ms"] < 20,
            "threads_p99_lag_over_100ms": threads["loop_lag"]["p99_ms"] > 100,
            "ray_turns_per_s_at_least_1.5x": speedup >= 1.5,
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.micro env_workers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="a folder; the report is written to DIR/env_workers.json")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8, help="env steps per trajectory")
    parser.add_argument("--inflight", type=int, default=32, help="trajectories in flight (and env threads)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="CPU each env step burns, ms")
    parser.add_argument("--workers", type=int, default=2, help="Ray env workers")
    parser.add_argument("--capacity", type=int, default=1, help="env calls per worker at once (its threads)")
    parser.add_argument("--repeats", type=int, default=1, help="passes of each mode; the median counts")
    args = parser.parse_args(argv)
    report = anyio.run(measure, args)
    emit(report, Path(args.out) / "env_workers.json")
    return report


if __name__ == "__main__":
    main()
