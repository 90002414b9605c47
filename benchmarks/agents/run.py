"""Agent benchmark: agent programs through the session gateway with partial rollout, against the same agents run
slime's way, on the same simulated SGLang server.

    python -m benchmarks.agents [--size small|default] [--seed 0] [--out DIR]

A long-tail agent workload: each sample is an agent (the official `openai` SDK, in a process of its own as agent
programs are: benchmarks/agents/farm.py, one process for them all) that makes 1 to 30 requests (Pareto-tailed,
`AgentPlan.max_requests`), each answered by the policy through the engine, and runs a tool between them for a
heavy-tailed time (lognormal, median `AgentPlan.tool_median_s`, capped at `tool_max_s`); the model's turns have the
simulated server's heavy-tailed lengths (benchmarks/longtail/simserver.py). The agent reports a reward at its end (the
env's `info["reward"]`). Both policies run the agents as agent envs (engine/agents/env.py) of a RolloutEngine
over the same SGLangBackend, so the gateway, the parsing and the HTTP cost the same; they differ where slime's
agent path and Turnstile differ:

  slime_style   one generate call per sample holding its slot for the whole session (slime's
                `--sglang-server-concurrency` semaphore around each sample's custom generate; at its default,
                512, every sample of the step at once), every sample of a step run to its end before the step
                returns (a barrier), no partial rollout
  turn_partial  Turnstile: a generation slot only while a request generates, `--over-sampling` x the step's
                groups in flight (`--in-flight fixed`, the default) or sized by the server's own load, at most
                that many (`--in-flight auto`; without `--over-sampling`, what max_inflight holds), partial rollout:
                the sessions left at a step's end keep running (their agents' requests held over the weight
                update)

Both keep `generation_slots` requests on the server at most (twice its running cap by default).

Both do the same weight update between steps. Per policy (report.json):
  trained_tokens_per_s  model tokens (loss mask 1) of the COMPLETED and TRUNCATED samples returned, over the
                        policy's wall time
  backend_utilization   time-integral of running requests / (the server's cap x wall time)
  step_seconds_p50 / p99, statuses (a session past max_staleness ends STALE: aborted, not trained), stale_share
  (the share of returned sessions that ended STALE), in_flight_groups_by_step (the sized goal at each step's end),
  staleness_histogram (trained tokens by weight versions behind the trainer), requests, sessions
and `speedup` (turn_partial's trained tokens per second over slime_style's).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx2
import numpy as np

import engine.agents.gateway  # noqa: F401  (imported before a clock starts: a cost of the process, not a step)
from benchmarks.agents.farm import AgentFarm, AgentPlan, FarmAgent
from benchmarks.longtail.common import version_index
from benchmarks.longtail.simserver import SimConfig, sim_post, sim_server
from engine.agents.env import AgentHost
from engine.backends.sglang import SGLangBackend
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import EnvRunner
from engine.scheduler.scheduler import SCORED
from engine.trajectory import Trajectory

POLICIES = ("slime_style", "turn_partial")
SLIME_CONCURRENCY = 512  # slime's --sglang-server-concurrency default: the semaphore each sample's generate holds


@dataclass(frozen=True)
class Agents:
    """The agents' behaviour (seeded per sample) and the run's shape."""

    target_groups: int = 8  # groups a step returns
    n_samples: int = 4
    num_steps: int = 10
    over_sampling: float | None = 5.0  # turn_partial: groups in flight per group a step returns (the most, with
    # in_flight auto; None: what max_inflight holds)
    in_flight: str = "fixed"  # turn_partial: over_sampling x the target (fixed) or sized by the server's load (auto)
    refill: float = 0.0  # turn_partial: more groups a step may start in its tail (EngineConfig.refill)
    scheduling: str = "fifo"  # turn_partial's priority policy (EngineConfig.policy)
    max_staleness: int = 3
    plan: AgentPlan = field(default_factory=AgentPlan)  # what each agent does (its requests, its tool times)
    max_new_tokens: int = 512
    generation_slots: int = 0  # requests on the server at once (0: twice its running cap, so its queue never runs dry)
    server: SimConfig = field(
        default_factory=lambda: SimConfig(max_running=16, median_tokens=60.0, max_turn_tokens=400)
    )


SIZES = {
    "default": Agents(),
    "small": Agents(target_groups=2, n_samples=2, num_steps=2, over_sampling=3.0, in_flight="auto",
                    plan=AgentPlan(max_requests=6, tool_median_s=0.1, tool_max_s=0.5),
                    server=SimConfig(max_running=4, median_tokens=20.0, max_turn_tokens=80)),
}  # fmt: skip


@dataclass
class PolicyRun:
    name: str
    started: float
    returned: list[list[Trajectory]] = field(default_factory=list)
    trainer_versions: list[str | None] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    in_flight_goals: list[int | None] = field(default_factory=list)  # groups in flight at each step's end (sized)
    wall_seconds: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)


def engine_config(config: Agents, policy: str) -> EngineConfig:
    step = config.target_groups * config.n_samples
    if policy == "slime_style":  # every sample of the step at once (within slime's default concurrency, 512)
        inflight, partial, over_sampling = min(step, SLIME_CONCURRENCY), False, 1.0
    else:
        over_sampling, partial = config.over_sampling, True
        inflight = EngineConfig.model_fields["max_inflight"].default  # the engine's, as a user leaves it
        if over_sampling is not None:
            inflight = math.ceil(config.target_groups * over_sampling) * config.n_samples
    return EngineConfig(
        n_samples_per_prompt=config.n_samples, max_inflight=inflight,
        max_generating=config.generation_slots or 2 * config.server.max_running,
        partial_rollout=partial, over_sampling=over_sampling, in_flight=config.in_flight if partial else "fixed",
        max_staleness=config.max_staleness,
        refill=config.refill if partial else 0.0, policy=config.scheduling,
        max_turns=config.plan.max_requests, max_tokens=64 * 1024, max_new_tokens=config.max_new_tokens, seed=0,
    )  # fmt: skip


async def run_policy(policy: str, config: Agents, encoder: ChatEncoder, backend: SGLangBackend, url: str) -> PolicyRun:
    rows = ({"prompt": f"task {i}", "metadata": {"task": i}} for i in range(10**9))
    async with AgentFarm(config.plan) as farm:  # the agents' process, started before the clock as their machines are
        await sim_post(url, "/sim/reset", {"weight_version": "v0"})
        await sim_post(url, "/stats/reset")
        run = PolicyRun(policy, started=time.monotonic())

        def build(sample: Any) -> EnvRunner:
            return EnvRunner(FarmAgent(sample.metadata["task"] * 1_000 + sample.index, farm))

        settings = engine_config(config, policy)  # the stop tokens: the encoder's, as the engine fills them in
        engine = RolloutEngine(backend=backend, encoder=encoder, env_factory=build, source=rows, config=settings)
        async with engine:
            for step in range(config.num_steps):
                started = time.monotonic()
                groups = await engine.rollout(config.target_groups)
                run.step_times.append(time.monotonic() - started)
                run.in_flight_goals.append(engine.sizer.goal if engine.sizer is not None else None)
                run.returned.append([t for group in groups for t in group.trajectories])
                run.trainer_versions.append(await backend.weight_version())
                await engine.pause()
                await backend.update_weights_from_disk("/sim/weights", weight_version=f"v{step + 1}")
                if step + 1 < config.num_steps:
                    await engine.resume(f"v{step + 1}")
            run.wall_seconds = time.monotonic() - run.started
            async with httpx2.AsyncClient(base_url=url, trust_env=False) as control:
                run.server = (await control.get("/stats")).raise_for_status().json()
            run.counts.update(AgentHost.of(engine.env_host).gateway.counts)
        run.counts["requests"] = farm.counts["requests"]
    return run


def summarize(run: PolicyRun) -> dict[str, Any]:
    staleness: Counter[int] = Counter()
    statuses: Counter[str] = Counter()
    trained = 0
    for trajectories, version in zip(run.returned, run.trainer_versions, strict=True):
        now = version_index(version)
        for t in trajectories:
            statuses[f"{t.status}/{t.stop_reason}"] += 1
            if t.status not in SCORED:
                continue
            for span in t.spans:
                n = sum(t.loss_mask[span.start : span.start + span.length])
                staleness[(now or 0) - (version_index(span.weight_version) or 0)] += n
                trained += n
    steps = run.step_times
    return {
        "trained_tokens_per_s": trained / run.wall_seconds,
        "backend_utilization": float(run.server.get("utilization", 0.0)),
        "backend_busy_fraction": float(run.server.get("busy_fraction", 0.0)),
        "mean_batch_size": float(run.server.get("mean_batch_size", 0.0)),
        "step_seconds_p50": float(np.percentile(steps, 50)),
        "step_seconds_p99": float(np.percentile(steps, 99)),
        "trained_tokens": trained,
        "generated_tokens": int(run.server.get("generated_tokens", 0)),
        "wall_seconds": run.wall_seconds,
        "samples_returned": sum(map(len, run.returned)),
        "statuses": dict(statuses),
        "stale_share": sum(n for key, n in statuses.items() if key.endswith("/stale")) / max(1, sum(statuses.values())),
        "in_flight_groups_by_step": run.in_flight_goals,
        "staleness_histogram": {str(k): v for k, v in sorted(staleness.items())},
        "agent_requests": run.counts["requests"],
        "agent_exits": {k.split(":", 1)[1]: v for k, v in run.counts.items() if k.startswith("agent_exits:")},
        "forks": {k.split(":", 1)[1]: v for k, v in run.counts.items() if k.startswith("forks:")},
    }


async def run_benchmark(config: Agents, *, policies: tuple[str, ...] = POLICIES, log: Any = print) -> dict[str, Any]:
    from engine.models import load_tokenizer

    encoder = ChatEncoder(load_tokenizer("qwen2.5"))
    report: dict[str, Any] = {"config": asdict(config), "policies": {}}
    with sim_server(config.server) as url:
        async with SGLangBackend(url, timeout=600.0) as backend:
            await backend.wait_until_healthy(30.0, poll_interval=0.1)
            for policy in policies:
                result = summarize(await run_policy(policy, config, encoder, backend, url))
                report["policies"][policy] = result
                log(
                    f"{policy:13} trained tokens/s {result['trained_tokens_per_s']:8.1f}  utilization "
                    f"{result['backend_utilization']:.3f}  steps p50 {result['step_seconds_p50']:.1f} s  "
                    f"requests {result['agent_requests']}  stale {result['stale_share']:.3f}"
                )
    if set(POLICIES) <= set(policies):
        slime, turn = report["policies"]["slime_style"], report["policies"]["turn_partial"]
        report["speedup"] = turn["trained_tokens_per_s"] / slime["trained_tokens_per_s"]
        report["targets"] = {
            "speedup_at_least_3": report["speedup"] >= 3.0,
            "utilization_at_least_0.85": turn["backend_utilization"] >= 0.85,
            "stale_share_at_most_0.1": turn["stale_share"] <= 0.1,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write report.json here")
    parser.add_argument("--num-steps", type=int, default=None, help="steps per policy (default: the size's)")
    parser.add_argument("--over-sampling", type=float, default=None, help="turn_partial's groups in flight per group")
    parser.add_argument("--in-flight", choices=("auto", "fixed"), default=None, help="turn_partial's in_flight")
    parser.add_argument("--refill", type=float, default=None)
    parser.add_argument("--scheduling", choices=("fifo", "group_completion", "oldest"), default=None)
    parser.add_argument("--max-staleness", type=int, default=None)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    args = parser.parse_args(argv)
    config = SIZES[args.size]
    overrides = {"num_steps": args.num_steps, "over_sampling": args.over_sampling, "refill": args.refill,
                 "in_flight": args.in_flight,
                 "scheduling": args.scheduling, "max_staleness": args.max_staleness}  # fmt: skip
    config = replace(config, server=replace(config.server, seed=args.seed),
                     **{k: v for k, v in overrides.items() if v is not None})  # fmt: skip
    report = anyio.run(partial(run_benchmark, config, policies=tuple(args.policies)))
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(text + "\n")
    print(text if args.out is None else f"wrote {args.out / 'report.json'}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
