"""The python tool sandbox's cost per call: bubblewrap (the default where it runs) against the hand-built
`unshare` sandbox it replaced.

    python -m benchmarks.micro sandbox [--out FILE] [--calls 60] [--concurrency 4] [--episodes 16] [--turns 4]

For each sandbox:
- start latency: from `run_python` being called to the code's first line running (the code prints the
  wall clock), over `--calls` calls one at a time, p50 and p99 in ms; and each call's whole time;
- calls per second: the same `--calls` trivial calls, `--concurrency` at a time;
- the python_tool env's turns per second: `--episodes` episodes stepped at once, each `--turns` tool calls
  (a short computation) then a final answer, through the env's own `astep` (the sandbox is the only work).
Targets: p50 start latency at most 2x the old sandbox's; the env's turns per second within 20%.
The report has the machine's core count and load average: on a shared machine, the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace
from typing import Any

import anyio

from benchmarks import emit
from engine.envs.loader import EnvSample
from engine.envs.python_tool import build_env
from engine.envs.python_tool.sandbox import Isolation, SandboxLimits, Tool, probe, run_python

LIMITS = SandboxLimits(wall_seconds=20)
FIRST_LINE = "import time\nprint(time.time())"
TOOL_CODE = "total = sum(i * i for i in range(20000))\nprint(total)"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def latency(found: Isolation, calls: int) -> dict[str, float]:
    starts, totals = [], []
    for _ in range(calls):
        called = time.time()
        result = await run_python(FIRST_LINE, LIMITS, found=found)
        assert result.ok, result.observation()
        starts.append((float(result.stdout) - called) * 1000)
        totals.append((time.time() - called) * 1000)
    return {
        "start_ms_p50": round(_percentile(starts, 0.5), 1),
        "start_ms_p99": round(_percentile(starts, 0.99), 1),
        "call_ms_p50": round(_percentile(totals, 0.5), 1),
        "call_ms_p99": round(_percentile(totals, 0.99), 1),
    }


async def throughput(found: Isolation, calls: int, concurrency: int) -> float:
    limiter = anyio.Semaphore(concurrency)

    async def one() -> None:
        async with limiter:
            assert (await run_python("print(1)", LIMITS, found=found)).ok

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        for _ in range(calls):
            group.start_soon(one)
    return round(calls / (time.monotonic() - started), 2)


async def env_turns(episodes: int, turns: int) -> float:
    """Turns per second of the python_tool env, `episodes` at once; its sandbox is `isolation()`'s."""
    call = json.dumps({"name": "python", "arguments": {"code": TOOL_CODE}})
    steps = 0

    async def episode() -> None:
        nonlocal steps
        metadata = {"task_id": "sum-multiples", "sandbox": {"wall_seconds": 20}}
        sample = EnvSample(prompt="", label="sum-multiples", metadata=metadata)
        env = build_env(sample, SimpleNamespace(max_turns=turns + 1))
        await env.areset()
        for _ in range(turns):
            observation, done, _ = await env.astep(f"<tool_call>\n{call}\n</tool_call>")
            assert not done and observation["obs_str"].startswith("exit status 0"), observation
            steps += 1
        _, done, info = await env.astep("<answer>233168</answer>")
        assert done and info["reward"] == 1.0
        steps += 1

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        for _ in range(episodes):
            group.start_soon(episode)
    return round(steps / (time.monotonic() - started), 2)


async def measure(tool: Tool, opts: argparse.Namespace) -> dict[str, Any]:
    from engine.envs.python_tool import sandbox

    os.environ["TURNSTILE_SANDBOX"] = tool.value
    sandbox.isolation.cache_clear()  # the env's calls go through isolation(): this tool's
    found = sandbox.isolation()
    await run_python("pass", LIMITS, found=found)  # warm: the first call reads the child's source
    return {
        "isolation": found.describe(),
        **await latency(found, opts.calls),
        "calls_per_s": await throughput(found, opts.calls, opts.concurrency),
        "env_turns_per_s": await env_turns(opts.episodes, opts.turns),
    }


async def main_async(opts: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "settings": vars(opts)}
    for tool in (Tool.UNSHARE, Tool.BUBBLEWRAP):
        probe(tool)  # an unusable sandbox is an error here, not a missing row
        report[tool.value] = await measure(tool, opts)
    old, new = report[Tool.UNSHARE.value], report[Tool.BUBBLEWRAP.value]
    report["start_p50_ratio"] = round(new["start_ms_p50"] / old["start_ms_p50"], 2)
    report["env_turns_ratio"] = round(new["env_turns_per_s"] / old["env_turns_per_s"], 2)
    report["load_avg_1m_after"] = os.getloadavg()[0]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4, help="tool calls per episode, then the answer")
    opts = parser.parse_args()
    emit(anyio.run(main_async, opts), opts.out)


if __name__ == "__main__":
    main()
