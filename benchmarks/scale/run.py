"""Many servers, long conversations: three placement policies on the same workload, and where one engine stops.

    python -m benchmarks.scale --servers 64 --out DIR [--size full|shared|smoke] [--seconds 240] [--policies ...]
        [--in-flight N] [--target-groups N] [--env-median-s S] [--no-saturation]

One simulated fleet (benchmarks/longtail/simserver.py in its many-server mode, its own process: per server a KV
capacity, a prefix cache, prefill paid for uncached tokens only) serves every policy in turn, each from a reset fleet.
The engine runs in this process with partial rollout on: `in_flight` trajectories (groups of `n_samples`), I/O-bound
envs (`ScaleEnv`: a coroutine that waits a heavy-tailed time per step), heavy-tailed trajectory lengths (turns and
observation sizes), the real Qwen tokenizer, one `SGLangBackend` per server in a `BackendPool` with the policy.
A weight update on every server every `update_every_s` empties their caches, as SGLang's does. Sizes: `full`
(the default: 4,096 trajectories in flight), `shared` (512, what an engine process with a sixth of a core keeps
up with) and `smoke` (4 servers, for the tests); docs/scaling.md gives the figures of each run.

Per policy (report.json, report.md):
  trained_tokens_per_s        model tokens of non-FAILED returned trajectories over the policy's wall time
  share_of_ceiling            generated tokens/s over the fleet's ceiling (`fleet_ceiling`: every slot of every
                              server running, nothing to prefill), which no policy passes; share_of_busy_ceiling:
                              the same over the ceiling x busy_fraction, what a policy that kept every slot full
                              whenever a server was busy would get; prefill_stall_share: the share of busy time
                              the servers spent prefilling (decoding stalls meanwhile)
  utilization                 time-integral of running requests / (servers x max_running x wall time); it is
                              busy_fraction (share of server time with a request running) x mean_batch_size
                              (requests running while busy) / max_running
  mean_waiting_requests       requests waiting in all the servers' queues together, on average; kv_blocked_share:
                              the share of slots free while requests waited for KV room (0: queues wait for slots)
  cached_share_after_turn1    cached / prompt tokens over the requests after a trajectory's first; also
                              `..._steady`, leaving out each trajectory's first request after a weight update;
                              a turn's new tokens (its observation) cannot be cached, so this is below 1 for
                              any policy: `cached_share_of_reusable` divides by what the trajectory's previous
                              request left on its server (that request's prompt and output) instead
  cpu_ms_per_turn             this process's CPU time (all threads) per generate request answered
  rss_kib_per_trajectory      this process's peak RSS less its RSS before the run, over `in_flight`
  loop_lag_ms_p50 / p99       how late a 10 ms timer fires on the engine's event loop
  live_trajectories_mean      trajectories not yet ended, sampled every 0.5 s: `in_flight` counts the groups' finished
                              members too, until their group is returned
The saturation run (`saturation` in the report) repeats the affinity policy with every latency cut to near zero,
so the engine process is CPU-bound: its turn rate there is the most one engine process sustains on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import anyio
import httpx2
import numpy as np

from benchmarks.longtail.simserver import sim_server
from benchmarks.longtail.workload import Workload
from benchmarks.scale.workload import SIZES, ScaleEnv, Size, fleet_ceiling
from engine.backends.affinity import POLICIES
from engine.backends.base import GenerateResult, SamplingParams
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend
from engine.backends.transport import http_transport
from engine.encoding import ChatEncoder
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import EnvRunner
from engine.scheduler.queue import Phase
from engine.trajectory import Status
from engine.turn import TurnLimits

LAG_INTERVAL_S = 0.01
LIVE_SAMPLE_S = 0.5


class MeteredPool:
    """The pool, noting per request whether it is its trajectory's first, and since when the caches are empty."""

    def __init__(self, pool: BackendPool):
        self.pool = pool
        self.epoch = 0  # weight updates so far
        self._seen: dict[str, tuple[int, int]] = {}  # session -> the epoch of its last request, and its tokens
        keys = ("requests", "first_prompt", "later_prompt", "later_cached", "later_reusable", "steady_prompt",
                "steady_cached")  # fmt: skip
        self.counts = dict.fromkeys(keys, 0)

    async def generate(self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None):
        result: GenerateResult = await self.pool.generate(
            input_ids, sampling_params, image_data, rid=rid, session_id=session_id
        )
        c = self.counts
        c["requests"] += 1
        last = self._seen.get(session_id) if session_id else None
        if last is None:
            c["first_prompt"] += result.prompt_tokens
        else:
            last_epoch, last_tokens = last
            c["later_prompt"] += result.prompt_tokens
            c["later_cached"] += result.cached_tokens
            c["later_reusable"] += min(last_tokens, result.prompt_tokens)  # what its last request left cached
            if last_epoch == self.epoch:
                c["steady_prompt"] += result.prompt_tokens
                c["steady_cached"] += result.cached_tokens
        if session_id:
            self._seen[session_id] = (self.epoch, result.prompt_tokens + len(result.token_ids))
        return result

    async def update_weights(self, version: str) -> None:
        async with anyio.create_task_group() as tg:
            for backend in self.pool.backends:
                tg.start_soon(backend.update_weights_from_disk, "/sim/weights", version)
        self.epoch += 1

    def __getattr__(self, name: str) -> Any:  # abort, pause, resume, weight_version, health, aclose
        return getattr(self.pool, name)


class LagMonitor:
    """How late a `LAG_INTERVAL_S` timer fires on this event loop; also samples this process's RSS."""

    def __init__(self):
        self.lags: list[float] = []
        self.peak_rss = rss_bytes()

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await anyio.sleep(LAG_INTERVAL_S)
            self.lags.append(time.monotonic() - started - LAG_INTERVAL_S)
            if len(self.lags) % 50 == 0:
                self.peak_rss = max(self.peak_rss, rss_bytes())

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.lags, q) * 1000) if self.lags else 0.0


def plain_http() -> httpx2.AsyncHTTPTransport:
    """The backend's own transport for plain http on this machine, with room for every trajectory in flight."""
    return http_transport(httpx2.Limits(max_connections=4096, keepalive_expiry=60), tls=False)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def engine_config(size: Size) -> EngineConfig:
    groups = -(-size.in_flight // size.n_samples)
    return EngineConfig(
        n_samples_per_prompt=size.n_samples, max_inflight=groups * size.n_samples,
        max_generating=groups * size.n_samples, max_env_steps=groups * size.n_samples,
        policy="oldest", partial_rollout=True, over_sampling=size.over_sampling, in_flight="fixed", max_staleness=1,
        on_stale="restart", limits=TurnLimits(max_turns=size.max_turns, max_tokens=size.max_tokens),
        sampling=SamplingParams(max_new_tokens=size.max_new_tokens), seed=0,
    )  # fmt: skip


async def run_policy(
    policy: str, size: Size, url: str, encoder: ChatEncoder, rss_baseline: int | None = None
) -> dict[str, Any]:
    """One policy from a reset fleet for `duration_s`, a weight update every `update_every_s`. RSS per trajectory
    is this process's peak RSS during the run less `rss_baseline` (default: its RSS as the run starts)."""
    async with httpx2.AsyncClient(base_url=url, trust_env=False, timeout=60) as client:
        (await client.post("/sim/reset", json={"weight_version": "v0"})).raise_for_status()
        (await client.post("/stats/reset")).raise_for_status()
    servers = [SGLangBackend(f"{url}/s/{i}", timeout=600.0, connect_timeout=120.0, transport=plain_http())
               for i in range(size.servers)]  # fmt: skip
    backend = MeteredPool(BackendPool(servers, policy=policy))
    workload = Workload("scale", env_median_s=size.env_median_s)
    rows = (workload.rows(1, start=i)[0] for i in range(10**9))
    sampling = SamplingParams(max_new_tokens=size.max_new_tokens, stop_token_ids=encoder.stop_token_ids)
    config = engine_config(size).model_copy(update={"sampling": sampling})
    monitor = LagMonitor()
    rss_before = rss_bytes() if rss_baseline is None else rss_baseline
    trained = num_trajectories = 0
    statuses: dict[str, int] = {}
    engine = RolloutEngine(
        backend=backend, encoder=encoder, source=rows, config=config,
        env_factory=lambda sample: EnvRunner(ScaleEnv(size, int(sample.metadata["prompt_id"]))),
    )  # fmt: skip
    live: list[int] = []  # trajectories not yet ended, every LIVE_SAMPLE_S

    async def count_live() -> None:
        while True:
            await anyio.sleep(LIVE_SAMPLE_S)
            phases = engine.scheduler.statistics().phases
            live.append(sum(n for phase, n in phases.items() if phase is not Phase.SCORING))

    started, cpu_started = time.monotonic(), time.process_time()
    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(monitor.run)
        tg.start_soon(count_live)
        updated, num_updates = started, 0
        while time.monotonic() - started < size.duration_s:
            for group in await engine.rollout(size.target_groups):
                for t in group.trajectories:
                    statuses[str(t.status)] = statuses.get(str(t.status), 0) + 1
                    num_trajectories += 1
                    trained += sum(t.loss_mask) if t.status is not Status.FAILED else 0
            if time.monotonic() - updated >= size.update_every_s:
                num_updates += 1
                await engine.pause()
                await backend.update_weights(f"v{num_updates}")
                await engine.resume(f"v{num_updates}")
                updated = time.monotonic()
        wall, cpu = time.monotonic() - started, time.process_time() - cpu_started
        tg.cancel_scope.cancel()
    async with httpx2.AsyncClient(base_url=url, trust_env=False, timeout=60) as client:
        fleet = (await client.get("/stats")).raise_for_status().json()
    await backend.aclose()
    c = backend.counts
    per_server = fleet.pop("per_server")
    generated_per_s = fleet["generated_tokens"] / wall
    share_of_ceiling = generated_per_s / fleet_ceiling(size)
    return {
        "trained_tokens_per_s": trained / wall,
        "utilization": fleet["utilization"],
        "busy_fraction": fleet["busy_fraction"],
        "mean_batch_size": fleet["mean_batch_size"],
        "kv_blocked_share": fleet["kv_blocked_share"],
        "mean_waiting_requests": fleet["waiting_seconds"] / fleet["wall_seconds"] if fleet["wall_seconds"] else 0.0,
        "share_of_ceiling": share_of_ceiling,
        "share_of_busy_ceiling": share_of_ceiling / fleet["busy_fraction"] if fleet["busy_fraction"] else 0.0,
        "prefill_stall_share": (
            fleet["prefill_tokens"] * size.server.prefill_s_per_token / fleet["busy_seconds"]
            if fleet["busy_seconds"]
            else 0.0
        ),
        "cached_share_after_turn1": c["later_cached"] / c["later_prompt"] if c["later_prompt"] else 0.0,
        "cached_share_after_turn1_steady": c["steady_cached"] / c["steady_prompt"] if c["steady_prompt"] else 0.0,
        "cached_share_of_reusable": c["later_cached"] / c["later_reusable"] if c["later_reusable"] else 0.0,
        "cpu_ms_per_turn": cpu / c["requests"] * 1000 if c["requests"] else 0.0,
        "turns_per_s": c["requests"] / wall,
        "engine_cpu_fraction": cpu / wall,
        "rss_kib_per_trajectory": max(0, monitor.peak_rss - rss_before) / 1024 / config.max_inflight,
        "live_trajectories_mean": float(np.mean(live)) if live else 0.0,
        "loop_lag_ms_p50": monitor.percentile_ms(50),
        "loop_lag_ms_p99": monitor.percentile_ms(99),
        "loop_lag_ms_max": monitor.percentile_ms(100),
        "wall_seconds": wall,
        "num_weight_updates": num_updates,
        "generated_tokens_per_s": generated_per_s,
        "trained_tokens": trained,
        "num_trajectories": num_trajectories,
        "statuses": statuses,
        "requests": c,
        "placement": backend.pool.placement_statistics(),
        "server_utilization_min_max": [
            min(s["utilization"] for s in per_server),
            max(s["utilization"] for s in per_server),
        ],  # fmt: skip
        "fleet": fleet,
    }


def saturation_size(size: Size) -> Size:
    """The same fleet and load with every latency near zero: the engine process is then the bottleneck."""
    fast = replace(size.server, decode_a=0.0002, decode_b=0.0, prefill_s_per_token=0.0)
    return replace(size, env_median_s=0.0005, duration_s=min(size.duration_s, 60.0), server=fast)


async def run_benchmark(size: Size, policies: tuple[str, ...], *, saturation: bool = True, log=print) -> dict:
    from engine.models import load_tokenizer

    encoder = ChatEncoder(load_tokenizer("qwen2.5"))
    encoder.encode_observation({"role": "user", "content": "warm up"})
    rss_baseline = rss_bytes()  # the tokenizer loaded: what the process holds before any trajectory
    config = {**asdict(size), "over_sampling": size.over_sampling, "fleet_ceiling_tokens_per_s": fleet_ceiling(size)}
    report: dict[str, Any] = {"config": config, "policies": {}}
    with sim_server(replace(size.server, servers=size.servers)) as url:
        for policy in policies:
            report["policies"][policy] = result = await run_policy(policy, size, url, encoder, rss_baseline)
            log(f"{policy:16} {_line(result)}")
    if saturation:
        fast = saturation_size(size)
        with sim_server(replace(fast.server, servers=fast.servers)) as url:
            report["saturation"] = result = await run_policy("affinity", fast, url, encoder, rss_baseline)
            log(f"{'saturation':16} {_line(result)}")
    report["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    return report


def _line(m: dict[str, Any]) -> str:
    return (
        f"{m['trained_tokens_per_s']:8.0f} tok/s  util {m['utilization']:.2f} (busy {m['busy_fraction']:.2f}, "
        f"batch {m['mean_batch_size']:.2f}, kv-blocked {m['kv_blocked_share']:.2f}, "
        f"waiting {m['mean_waiting_requests']:.0f})  "
        f"{m['share_of_ceiling']:.2f} of ceiling ({m['share_of_busy_ceiling']:.2f} while busy, prefill "
        f"{m['prefill_stall_share']:.3f})  "
        f"cached {m['cached_share_after_turn1']:.3f} (steady {m['cached_share_after_turn1_steady']:.3f}, "
        f"of reusable {m.get('cached_share_of_reusable', 0):.3f})  "
        f"{m['turns_per_s']:6.0f} turns/s  cpu {m['cpu_ms_per_turn']:.2f} ms/turn ({m['engine_cpu_fraction']:.2f})  "
        f"lag p99 {m['loop_lag_ms_p99']:.1f} ms  rss {m['rss_kib_per_trajectory']:.1f} KiB/traj"
    )


COLUMNS = (
    ("trained tok/s", "trained_tokens_per_s", "{:.0f}"),
    ("generated, of the fleet's ceiling", "share_of_ceiling", "{:.2f}"),
    ("same, of the ceiling while busy", "share_of_busy_ceiling", "{:.2f}"),
    ("prefill share of busy time", "prefill_stall_share", "{:.3f}"),
    ("utilization", "utilization", "{:.2f}"), ("busy", "busy_fraction", "{:.2f}"),
    ("running while busy", "mean_batch_size", "{:.2f}"), ("waiting", "mean_waiting_requests", "{:.0f}"),
    ("KV-blocked", "kv_blocked_share", "{:.2f}"), ("live trajectories", "live_trajectories_mean", "{:.0f}"),
    ("cached after turn 1", "cached_share_after_turn1", "{:.3f}"),
    ("same, no update between", "cached_share_after_turn1_steady", "{:.3f}"),
    ("cached of reusable", "cached_share_of_reusable", "{:.3f}"),
    ("turns/s", "turns_per_s", "{:.0f}"), ("CPU ms/turn", "cpu_ms_per_turn", "{:.2f}"),
    ("engine CPU share", "engine_cpu_fraction", "{:.2f}"), ("loop lag p50 ms", "loop_lag_ms_p50", "{:.1f}"),
    ("loop lag p99 ms", "loop_lag_ms_p99", "{:.1f}"), ("RSS KiB/trajectory", "rss_kib_per_trajectory", "{:.1f}"),
)  # fmt: skip


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = {**report["policies"], **({"saturation (affinity)": report["saturation"]} if "saturation" in report else {})}
    lines = ["| policy | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, m in rows.items():
        lines.append(f"| {name} | " + " | ".join(fmt.format(m[key]) for _, key, fmt in COLUMNS) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--servers", type=int, help="simulated servers (default: the size's)")
    parser.add_argument("--in-flight", type=int, help="trajectories in flight (default: the size's)")
    parser.add_argument("--seconds", type=float, help="seconds each policy runs (default: the size's)")
    parser.add_argument("--target-groups", type=int, help="groups a step returns (default: the size's)")
    parser.add_argument("--env-median-s", type=float, help="median seconds of a tool call (default: the size's)")
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=["affinity", "consistent_hash", "round_robin"]
    )
    parser.add_argument("--no-saturation", action="store_true", help="skip the saturation run")
    parser.add_argument(
        "--shards", type=int, default=0,
        help="also run the workload through this many rollout shards, Ray actors (benchmarks/scale/sharded.py)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("scale-report"))
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    overrides = {
        "servers": args.servers, "in_flight": args.in_flight, "duration_s": args.seconds,
        "target_groups": args.target_groups,
    }  # fmt: skip
    for name, value in overrides.items():
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.env_median_s is not None and args.env_median_s <= 0:
        parser.error(f"--env-median-s must be above 0, got {args.env_median_s}")
    overrides["env_median_s"] = args.env_median_s
    size = replace(size, **{k: v for k, v in overrides.items() if v is not None})
    if size.over_sampling < 1:
        parser.error(f"{size.in_flight} in flight cannot hold {size.target_groups} groups of {size.n_samples}")
    started = time.monotonic()
    report = anyio.run(lambda: run_benchmark(size, tuple(args.policies), saturation=not args.no_saturation))
    if args.shards:
        from benchmarks.scale.sharded import run_sharded

        with sim_server(replace(size.server, servers=size.servers)) as url:
            report["sharded"] = result = run_sharded(size, url, args.shards)
        print(
            f"{args.shards} shards: util {result['utilization']:.2f}  {result['turns_per_s']:.0f} turns/s  "
            f"coordination {result['coordinator_cpu_ms_per_turn']:.3f} ms/turn, shards "
            f"{result['shard_cpu_ms_per_turn']:.2f} ms/turn ({result['coordination_share']:.3f})"
        )
    report["size"], report["total_seconds"] = args.size, time.monotonic() - started
    write_outputs(report, args.out)
    print(f"wrote {args.out}/report.json and report.md in {report['total_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
