"""Long-tail benchmark: slime-style rollout versus Turnstile's turn-level scheduler, side by side.

    python -m benchmarks.longtail --size small|large --out DIR [--reward-source rm|env] [--reward-ms 20]

One process run starts a simulated SGLang server (benchmarks/longtail/simserver.py, its own process: SGLang's
HTTP API, continuous-batching timing, heavy-tailed response lengths) and runs the same seeded
workload (benchmarks/longtail/workload.py: a blocking env with heavy-tailed latency and failures) under each
policy, for two envs: ~1 ms and ~30 ms per step.

Rewards (`--reward-source`): by default ("rm") they come from a reward function, as in slime runs
with `--rm-type` or a remote reward model: the env reports none, and each ended trajectory is scored
by an async call that answers after `--reward-ms` (0: a synchronous rule-based reward) with the value
the env would have given, so the figures stay comparable with "env" (the env's info["reward"], as
before). The default, 20 ms, is an HTTP round trip to a reward service with a short forward pass:
below the env's median step, and at most one call on a step's critical path, so with the large
size's steps of seconds the throughput figures stay comparable with those measured before; an LLM
judge takes seconds (pass its latency to see what that costs).
Turnstile passes it as `RolloutEngine(reward_fn=...)` (each trajectory scored as it ends, while the
others generate); slime_style awaits it as slime's `generate_and_rm` does: after generation, outside
the concurrency semaphore, per sample, before its group counts as done.

  slime_style   one coroutine per trajectory holding a concurrency slot throughout, env steps
                blocking the event loop, a barrier per step, no partial rollout (slime.py)
  turn          Turnstile: turn-level slots, no partial rollout (turnstile.py)
  turn_partial  Turnstile: turn-level slots, partial rollout (over-sampling, pause, resume)

Every policy does the same weight update between steps. Per policy (report.json, report.md):
  trained_tokens_per_s      model tokens (loss mask 1) of non-FAILED samples handed to the trainer,
                            over the policy's wall time
  step_seconds_p50 / p99    time of each rollout step
  backend_utilization       time-integral of running requests / (the server's cap x wall time)
  backend_busy_fraction     share of wall time with at least one request running
  mean_batch_size           running requests, time-averaged while busy
  discarded_token_fraction  (generated - trained - unfinished) / generated, generated counted by the server
  unfinished_token_fraction model tokens still held at the end (paused, or done and not yet returned)
  stale_le1_fraction        share of trained tokens at most one weight version behind the trainer
  reward_calls, reward_seconds   calls of the reward function and the seconds from each call to its
                            answer, a late wake-up of the event loop included (slime_style's blocking env
                            steps delay it); every call of the policy's run, held and rerun trajectories
                            included; also _per_call and _per_step
  reward_group_wait_seconds_mean / p99   per returned group: from its last member's end (generation
                            and env done) to its last member scored, when the group is ready
  reward_tail_seconds       per step, from the last end among the step's returned trajectories to
                            the last of them scored: the reward's share of the step's critical path
                            (summed; _per_step its mean; reward_tail_fraction: over the step seconds)
  collector_pauses          this process's garbage-collector passes during the policy's run: how many, their
                            seconds, and each full pass in ms (every pass stops the event loop; Turnstile's engine
                            freezes what is alive when it starts, EngineConfig.gc_freeze, unless --no-gc-freeze)
DIR also gets timeline.png (a sample of trajectories of one step per policy) and throughput.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import anyio

from benchmarks.longtail.common import CollectorPauses, PolicyRun, Setup, TimedBackend, build_timeline, summarize
from benchmarks.longtail.simserver import SimConfig, sim_post, sim_server
from benchmarks.longtail.workload import Workload
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.encoding import ChatEncoder
from engine.gc_freeze import freeze_alive
from engine.turn import TurnLimits

POLICIES = ("slime_style", "turn", "turn_partial")
HEADLINE = "env_30ms"
NOTES = [
    "slime_style is generous to slime: an env exception fails only its trajectory. slime at HEAD lets it "
    "propagate out of generate_rollout, and the whole rollout step is lost.",
    "slime_style decodes response text on the client with the same ChatEncoder as Turnstile; the "
    "simulated server's `text` is a placeholder.",
    "Turnstile retries env failures within its budgets (EnvRetryableError and other exceptions); "
    "slime_style does not retry, as slime does not.",
    "Each policy starts from a reset server (weights v0, empty prefix cache, fresh model variants); the "
    "server flushes its prefix cache on every weight update, as SGLang does, so resumed trajectories "
    "pay their prefill again.",
    "Staleness of a trained token: the trainer's version when the step returns (the server's, before "
    "the update) minus the version that generated it, from Trajectory.spans.",
    "Unfinished tokens (held by Turnstile at the end: paused, or in groups done and not yet returned) "
    "are neither trained nor discarded; over a longer run they are trained in the next step.",
    "With reward_source rm the env reports no reward and every policy scores with the same reward function "
    "(a fixed latency, then the value the env would have given; 0.0 for a trajectory a budget cut short). "
    "Turnstile scores COMPLETED and TRUNCATED trajectories, as its engine does; slime_style scores every "
    "sample that is not ABORTED, as slime's generate_and_rm does.",
]


@dataclass(frozen=True)
class Size:
    """A benchmark configuration. Each rollout step asks for `target_groups` groups of `n_samples`
    (twice the server's cap on running requests in `large`). Over-sampling and refill trade
    utilization against staleness: more groups in flight straddle two weight updates more often, and
    the members that finished early wait for their stragglers, so more tokens are two versions old by
    the time their group returns (restarted, or trained two versions stale, as `max_staleness` says);
    "oldest" serves the trajectories admitted first, which bounds that tail."""

    target_groups: int
    num_steps: int
    n_samples: int = 8
    over_sampling: float = 1.75  # Turnstile with partial rollout keeps target x this many groups in flight
    refill: float = 0.0  # and starts up to target x this many more in a step's tail (EngineConfig.refill)
    max_staleness: int = 1  # weight versions a token may lag when its trajectory resumes or returns
    scheduling: str = "oldest"  # Turnstile's priority policy: fifo | group_completion | oldest
    max_env_steps: int = 64
    max_new_tokens: int = 1024  # per turn
    max_tokens: int = 8192  # per trajectory, generated + observation tokens
    env_medians: dict[str, float] = field(default_factory=lambda: {"env_1ms": 0.001, HEADLINE: 0.03})
    reward_source: str = "rm"  # "rm": a reward function scores each ended trajectory; "env": the env's info
    reward_latency_s: float = 0.02  # one reward call with "rm" (0: a synchronous rule)
    gc_freeze: bool = True  # Turnstile's EngineConfig.gc_freeze
    server: SimConfig = SimConfig()


SIZES = {
    "small": Size(
        target_groups=4,
        num_steps=3,
        n_samples=4,
        max_new_tokens=512,
        max_tokens=4096,
        server=SimConfig(max_running=16, median_tokens=20.0, max_turn_tokens=200),
    ),
    # 30 groups in flight for the 16 a step returns; some straddle two weight updates, so the bound is 2. 31 keep the
    # server fuller and leave fewer trained tokens at most one version old; 28 and refill 0.15 (3 more in a step's
    # tail) move that share from run to run: docs/scaling.md.
    "large": Size(
        target_groups=16, num_steps=10, over_sampling=1.875, max_staleness=2, server=SimConfig(max_running=64)
    ),
}


def sized(name: str, **overrides: Any) -> Size:
    """A size by name, with fields replaced (`server` overrides go into its SimConfig)."""
    base = SIZES[name]
    server = overrides.pop("server", {})
    return Size(**{**{f.name: getattr(base, f.name) for f in fields(Size)}, **overrides,
                   "server": SimConfig(**{**asdict(base.server), **server})})  # fmt: skip


async def run_policy(name: str, setup: Setup) -> PolicyRun:
    await sim_post(setup.server_url, "/sim/reset", {"weight_version": "v0"})
    setup.reset_records()
    await sim_post(setup.server_url, "/stats/reset")
    if setup.gc_freeze:  # what the earlier policies left (their reports) costs this one's collector passes nothing
        freeze_alive()
    with CollectorPauses() as collector:
        if name == "slime_style":
            from benchmarks.longtail.slime import run_slime_style

            run = await run_slime_style(setup)
        else:
            from benchmarks.longtail.turnstile import run_turnstile

            run = await run_turnstile(setup, partial=name == "turn_partial")
    run.rewards, run.collector = setup.rewards, collector.summary()
    return run


async def run_benchmark(
    size: Size, *, seed: int = 0, policies: tuple[str, ...] = POLICIES, log=print
) -> dict[str, Any]:
    """Run every workload of `size` under every policy; the report as a dict (timelines included)."""
    from engine.models import load_tokenizer

    encoder = ChatEncoder(load_tokenizer("qwen2.5"))
    sampling = SamplingParams(max_new_tokens=size.max_new_tokens, stop_token_ids=encoder.stop_token_ids)
    report: dict[str, Any] = {"workloads": {}, "timelines": {}}
    with sim_server(size.server) as url:
        async with SGLangBackend(url, timeout=600.0) as backend:
            await backend.wait_until_healthy(30.0, poll_interval=0.1)
            for workload_name, median in size.env_medians.items():
                workload = Workload(
                    workload_name, env_median_s=median, seed=seed, reward_source=size.reward_source,
                    reward_latency_s=size.reward_latency_s,
                )  # fmt: skip
                setup = Setup(
                    backend=TimedBackend(backend), encoder=encoder, workload=workload, sampling=sampling,
                    limits=TurnLimits(max_turns=workload.max_turns, max_tokens=size.max_tokens),
                    n_samples=size.n_samples, num_steps=size.num_steps, target_groups=size.target_groups,
                    concurrency=size.server.max_running, max_env_steps=size.max_env_steps,
                    over_sampling=size.over_sampling, refill=size.refill, max_staleness=size.max_staleness,
                    scheduling=size.scheduling, gc_freeze=size.gc_freeze, server_url=url,
                )  # fmt: skip
                results, timelines = {}, {}
                for policy in policies:
                    run = await run_policy(policy, setup)
                    results[policy] = summarize(run)
                    timelines[policy] = build_timeline(run, setup, step=min(1, len(run.returned) - 1))
                    log(f"{workload_name:9} {policy:13} {_line(results[policy])}")
                report["workloads"][workload_name] = {
                    "env_median_s": median, "reward_source": workload.reward_source,
                    "reward_latency_s": workload.reward_latency_s, "policies": results,
                }  # fmt: skip
                report["timelines"][workload_name] = timelines
    headline = HEADLINE if HEADLINE in report["workloads"] else next(iter(report["workloads"]))
    report["policies"] = report["workloads"][headline]["policies"]
    report["headline_workload"] = headline
    per_size = ("name", "env_median_s", "reward_source", "reward_latency_s")  # in the size's config
    workload = {k: v for k, v in asdict(Workload("", 0.0, seed=seed)).items() if k not in per_size}
    report["config"] = {"seed": seed, **asdict(size), "workload": workload}
    report["notes"] = NOTES
    return report


def _line(m: dict[str, Any]) -> str:
    return (
        f"{m['trained_tokens_per_s']:8.0f} tok/s  "
        f"step p50 {m['step_seconds_p50']:6.2f}s p99 {m['step_seconds_p99']:6.2f}s  "
        f"util {m['backend_utilization']:.2f} busy {m['backend_busy_fraction']:.2f}  "
        f"discarded {m['discarded_token_fraction']:.3f}  stale<=1 {m['stale_le1_fraction']:.3f}  "
        f"reward {m['reward_calls']} calls {m['reward_seconds']:.2f}s tail {m['reward_tail_fraction']:.3f}"
    )


def write_outputs(report: dict[str, Any], out: Path) -> None:
    from benchmarks.longtail.report import plot_throughput, plot_timeline, write_markdown

    out.mkdir(parents=True, exist_ok=True)
    timelines = report.pop("timelines")
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "timelines.json").write_text(json.dumps(timelines) + "\n")
    write_markdown(report, out / "report.md")
    plot_throughput(report, out / "throughput.png")
    plot_timeline(timelines[report["headline_workload"]], out / "timeline.png", title=report["headline_workload"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.longtail", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--out", type=Path, default=Path("longtail-report"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument(
        "--scheduling", choices=["fifo", "group_completion", "oldest"], help="Turnstile's priority policy"
    )
    parser.add_argument("--over-sampling", type=float, help="Turnstile's over-sampling with partial rollout")
    parser.add_argument("--refill", type=float, help="Turnstile's refill of a step's tail with partial rollout")
    parser.add_argument("--max-staleness", type=int, help="Turnstile's bound on a token's staleness")
    parser.add_argument("--steps", type=int, help="rollout steps per policy")
    parser.add_argument(
        "--no-gc-freeze", action="store_true", help="neither Turnstile's engine nor the benchmark freezes what is alive"
    )
    parser.add_argument("--env", choices=["env_1ms", HEADLINE], help="run one workload only")
    parser.add_argument(
        "--reward-source", choices=["rm", "env"], default="rm",
        help="rm: a reward function scores each ended trajectory (default); env: the env's info['reward']",
    )  # fmt: skip
    parser.add_argument(
        "--reward-ms", type=float, default=20.0,
        help="latency of one reward call with --reward-source rm (default 20; 0: a synchronous rule)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.reward_ms < 0:
        parser.error("--reward-ms must be >= 0")
    overrides: dict[str, Any] = {
        key: value
        for key, value in (
            ("scheduling", args.scheduling),
            ("over_sampling", args.over_sampling),
            ("refill", args.refill),
            ("max_staleness", args.max_staleness),
            ("num_steps", args.steps),
            ("reward_source", args.reward_source),
            ("reward_latency_s", args.reward_ms / 1000),
            ("gc_freeze", False if args.no_gc_freeze else None),
        )
        if value is not None
    }
    if args.env:
        overrides["env_medians"] = {args.env: SIZES[args.size].env_medians[args.env]}
    size = sized(args.size, **overrides)
    started = time.monotonic()
    report = anyio.run(lambda: run_benchmark(size, seed=args.seed, policies=tuple(args.policies)))
    report["size"] = args.size
    report["total_seconds"] = time.monotonic() - started
    write_outputs(report, args.out)
    print(f"wrote {args.out}/report.json, report.md, timeline.png, throughput.png in {report['total_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
