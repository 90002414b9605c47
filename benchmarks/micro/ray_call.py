"""What one call through Ray costs in CPU, beside the work it carries: the path every env-worker step takes.

    python -m benchmarks.micro ray_call --out FILE [--calls 400] [--concurrency 16] [--step-ms 10]

One actor, one caller (this process, an asyncio loop awaiting `actor.method.remote(...)`, `--concurrency`
calls at once). Modes:

- `async_noop`: an async actor's method that returns at once (Ray's path alone, calls back to back);
- `async_cpu_thread`: an async actor that runs `--step-ms` of pure-Python CPU in a thread it keeps (a
  long-lived task's anyio thread, one at a time), as an env worker runs a sync env's step;
- `async_cpu_inline`: the same CPU on the async actor's event loop;
- `threaded_cpu`: a threaded (sync) actor that runs it in Ray's own executor thread.

For each: calls per second and the CPU per call of the caller and of the actor's process (all threads,
from /proc), and the actor's CPU per call less the call's own `--step-ms` (`actor_overhead_ms`). On a
machine with fewer cores than processes, the figures move with whatever else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import anyio

from benchmarks import emit
from benchmarks.micro.env_workers import burn, process_cpu_s
from engine.envs.ray_workers import TaskHost

MODES = ("async_noop", "async_cpu_thread", "async_cpu_inline", "threaded_cpu")


class AsyncActor:
    """An async actor: its calls run on its event loop; `cpu_thread` hops to a thread it keeps, as EnvWorker."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self._hosted = TaskHost().run  # as an env worker runs its calls
        self._limiter: anyio.CapacityLimiter | None = None

    async def pid(self) -> int:
        return os.getpid()

    async def noop(self, key: str, text: str) -> tuple[Any, ...]:
        return None, None, False

    async def cpu_inline(self, key: str, text: str) -> tuple[Any, ...]:
        burn(self.step_s)
        return None, None, False

    async def cpu_thread(self, key: str, text: str) -> tuple[Any, ...]:
        self._limiter = self._limiter or anyio.CapacityLimiter(1)  # made on the actor's event loop
        await self._hosted(anyio.to_thread.run_sync, burn, self.step_s, limiter=self._limiter)
        return None, None, False


class ThreadedActor:
    """A threaded actor: each call runs in one of Ray's executor threads."""

    def __init__(self, step_s: float):
        self.step_s = step_s

    def pid(self) -> int:
        return os.getpid()

    def cpu(self, key: str, text: str) -> tuple[Any, ...]:
        burn(self.step_s)
        return None, None, False


async def measure_mode(ray: Any, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    step_s = args.step_ms / 1000
    if mode == "threaded_cpu":
        actor, method = ray.remote(max_concurrency=1)(ThreadedActor).remote(step_s), "cpu"
    else:
        actor, method = ray.remote(AsyncActor).remote(step_s), mode.removeprefix("async_")
    pid = await actor.pid.remote()
    call = getattr(actor, method)
    calls = args.calls * (20 if mode == "async_noop" else 1)  # a no-op call takes a fiftieth of the time
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        async with gate:
            await call.remote(f"{i:032x}", "the model's turn")

    await asyncio.gather(*(one(i) for i in range(args.concurrency)))  # warm: connections, the thread
    caller, worker, started = time.process_time(), process_cpu_s(pid), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(calls)))
    seconds = time.perf_counter() - started
    caller, worker = time.process_time() - caller, process_cpu_s(pid) - worker
    ray.kill(actor)
    work_ms = 0.0 if mode == "async_noop" else args.step_ms
    return {
        "calls": calls,
        "calls_per_s": round(calls / seconds, 1),
        "caller_cpu_ms_per_call": round(caller / calls * 1000, 3),
        "actor_cpu_ms_per_call": round(worker / calls * 1000, 3),
        "actor_overhead_ms": round(worker / calls * 1000 - work_ms, 3),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_worker_niceness", "0")  # as benchmarks.micro.env_workers
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    modes = {mode: await measure_mode(ray, mode, args) for mode in args.modes}
    return {
        "benchmark": "ray_call",
        "machine": {"cpus": os.cpu_count(), "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]},
        "workload": {"calls": args.calls, "concurrency": args.concurrency, "step_cpu_ms": args.step_ms},
        "modes": modes,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.micro ray_call", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON report here too")
    parser.add_argument("--calls", type=int, default=400, help="calls per CPU mode (20x for async_noop)")
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight at once")
    parser.add_argument("--step-ms", type=float, default=10.0, help="CPU each call of the CPU modes burns, ms")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args(argv)
    report = asyncio.run(measure(args))
    emit(report, Path(args.out) if args.out else None)
    return report


if __name__ == "__main__":
    main()
