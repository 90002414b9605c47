"""Rollout shards: turns per second with 1, 2, ... shards, and the CPU the place deciding for them spends per turn.

    python -m benchmarks.scale.shards --out FILE [--shards 1 2] [--servers 16] [--steps 6] [--target-groups 16]

One simulated fleet (benchmarks/longtail/simserver.py, many-server mode, its own process) answers at near-zero latency,
and the env answers at once, so the shards are the bottleneck: what is measured is how far the rollout's own CPU spreads
over processes. For each shard count, a ShardedService (bridge/shards.py) drives Ray actor shards, each a
RolloutService with the real Qwen tokenizer, partial rollout and `turns` turns per trajectory, through `steps`
rollout steps after one to warm up (the shards' tokenizers, the servers' caches).

Per shard count (report["runs"]):
  turns_per_s                   turns of the returned trajectories over the measured steps' wall time
  coordinator_cpu_ms_per_turn   this process's CPU (every thread: placing groups, watching the shards, summing the
                                step, receiving the samples) per turn: the part that does not spread over shards
  shard_cpu_ms_per_turn         the shards' processes' CPU per turn, summed over shards
  coordination_share            coordinator / shard CPU per turn (target: at most 0.05, so 16 shards stay within
                                one core of coordination)
  fleet_cpu_ms_per_turn         the simulated fleet's process's CPU per turn (it shares this machine's cores)
report["speedup"] is turns_per_s of each count over that of one shard; report["projection"] the turns per second N
shards would reach with a core each: N x one shard's rate, capped by what one core of coordination sustains
(1000 / coordinator_cpu_ms_per_turn).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, replace
from typing import Any

import psutil

from benchmarks import emit
from benchmarks.longtail.simserver import SimConfig, sim_server
from benchmarks.micro.bridge_overhead import RM_PATH, data_source
from bridge.settings import BridgeSettings

FAST = SimConfig(
    max_running=64, decode_a=0.0002, decode_b=0.0, prefill_s_per_token=0.0, median_tokens=40.0, sigma=0.5,
    max_turn_tokens=200, kv_tokens=400_000,
)  # fmt: skip
PROJECTED = (1, 2, 4, 8, 16)


def process_cpu_seconds(process: psutil.Process) -> float:
    """user + system CPU seconds of `process`."""
    times = process.cpu_times()
    return times.user + times.system


def cpu_per_turn(coordinator_cpu_s: float, before: list[dict], after: list[dict], turns: int) -> dict[str, float]:
    """The deciding process's and the shards' CPU per turn (the shards' `status()` before and after the run, which
    say their process's CPU seconds), and the first over the second."""
    shard_cpu_s = sum(a["cpu_seconds"] - b["cpu_seconds"] for a, b in zip(after, before, strict=True))
    return {
        "coordinator_cpu_ms_per_turn": 1000 * coordinator_cpu_s / turns if turns else 0.0,
        "shard_cpu_ms_per_turn": 1000 * shard_cpu_s / turns if turns else 0.0,
        "coordination_share": coordinator_cpu_s / shard_cpu_s if shard_cpu_s else 0.0,
    }


def settings(url: str, *, shards: int, target_groups: int, n_samples: int, turns: int) -> BridgeSettings:
    return BridgeSettings(
        url=url, env_path="benchmarks.micro.bridge_overhead", max_turns=turns, n_samples_per_prompt=n_samples,
        target_groups=target_groups, partial_rollout=True, over_sampling=2.0, max_new_tokens=200,
        max_generating=256, max_inflight=4096, ray_actor=f"turnstile-bench-{shards}", shards=shards,
    )  # fmt: skip


def run(
    url: str, sim: psutil.Process, *, shards: int, steps: int, target_groups: int, n_samples: int, turns: int
) -> dict:
    from types import SimpleNamespace

    from bridge.shards import ray_shards

    s = settings(url, shards=shards, target_groups=target_groups, n_samples=n_samples, turns=turns)
    args = SimpleNamespace(max_turns=turns, custom_rm_path=RM_PATH)  # what the env and the reward read
    service = ray_shards(s, args)
    prompts = iter(data_source(100_000, n_samples))
    try:

        def step(rollout_id: int) -> int:
            groups = [next(prompts) for _ in range(service.wanted(target_groups))]
            out = service.rollout(rollout_id, target_groups, groups)
            assert len(out.samples) == target_groups, f"step {rollout_id} returned {len(out.samples)} groups"
            return sum(len(sample.metadata["turns"]) for group in out.samples for sample in group)

        step(0)  # warm up
        before = service.status()["shards"]
        sim_before, cpu_before, started = process_cpu_seconds(sim), time.process_time(), time.monotonic()
        turns_done = sum(step(i) for i in range(1, steps + 1))
        wall, cpu = time.monotonic() - started, time.process_time() - cpu_before
        sim_cpu = process_cpu_seconds(sim) - sim_before
        after = service.status()["shards"]
    finally:
        service.shutdown()
    return {
        "shards": shards,
        "turns": turns_done,
        "wall_s": wall,
        "turns_per_s": turns_done / wall,
        **cpu_per_turn(cpu, before, after, turns_done),
        "fleet_cpu_ms_per_turn": 1000 * sim_cpu / turns_done,
        "pids": sorted({a["pid"] for a in after}),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON report here too")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--servers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--target-groups", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args(argv)

    import ray

    cores = os.cpu_count() or 1
    ray.init(num_cpus=max(cores, max(args.shards)), include_dashboard=False, namespace="turnstile", log_to_driver=False)
    runs = []
    try:
        with sim_server(replace(FAST, servers=args.servers)) as url:
            [sim] = [c for c in psutil.Process().children() if "benchmarks.longtail.simserver" in " ".join(c.cmdline())]
            urls = ",".join(f"{url}/s/{i}" for i in range(args.servers))
            for n in args.shards:
                runs.append(
                    run(urls, sim, shards=n, steps=args.steps, target_groups=args.target_groups,
                        n_samples=args.samples_per_prompt, turns=args.turns)
                )  # fmt: skip
                print(f"shards={n}: {runs[-1]}", flush=True)
    finally:
        ray.shutdown()
    one = next((r for r in runs if r["shards"] == 1), None)
    report: dict[str, Any] = {
        "config": {**vars(args), "cores": cores, "sim": asdict(FAST)},
        "runs": runs,
    }
    if one is not None:
        report["speedup"] = {str(r["shards"]): r["turns_per_s"] / one["turns_per_s"] for r in runs}
        ceiling = 1000 / max(r["coordinator_cpu_ms_per_turn"] for r in runs)
        per_core = 1000 / one["shard_cpu_ms_per_turn"]  # what one shard with a core of its own sustains
        report["projection"] = {
            "turns_per_s_per_shard_core": per_core,
            "coordination_ceiling_turns_per_s": ceiling,
            "turns_per_s": {str(n): min(n * per_core, ceiling) for n in PROJECTED},
        }
    report["targets"] = {
        "coordination_share_at_most_0.05": all(r["coordination_share"] <= 0.05 for r in runs),
        "speedup_2_at_least_1.8": report.get("speedup", {}).get("2", 0.0) >= 1.8,
    }
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
