"""`python -m benchmarks.scale --shards N`: the scale workload through N rollout shards (bridge/shards.py).

The same fleet, envs and prompts as the in-process run (run.py), driven the way slime drives the rollout: a
ShardedService in this process decides, N RolloutServices in Ray actors of their own run the trajectories, each
with a BackendPool (affinity) over every simulated server. The simulated fleet is a process of its own, so the
shards' processes are theirs and this one's is the service's. Per run (report["sharded"]):

  utilization, busy_fraction, ... the fleet's own figures, as in run.py
  trained_tokens_per_s          model tokens of the non-FAILED samples returned, over the run's wall time
  turns_per_s                   generate requests the fleet answered (a turn each, or part of one continued after
                                a pause) over the wall time: the work done, returned or not
  coordinator_cpu_ms_per_turn   this process's CPU (deciding, and receiving the samples) per turn
  shard_cpu_ms_per_turn         the shards' processes' CPU per turn, summed over shards
  coordination_share            the two over each other (target: at most 0.05)
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import httpx2

from benchmarks.longtail.simserver import REPO
from benchmarks.longtail.workload import Workload
from benchmarks.scale.shards import cpu_per_turn
from benchmarks.scale.workload import ScaleEnv, Size, fleet_ceiling


def build_env(sample: Any = None, args: Any = None, **_: Any) -> ScaleEnv:
    """The env of the shards (the bridge's `build_env`): the workload's ScaleEnv, of the size in `args.scale_size`."""
    return ScaleEnv(args.scale_size, int(sample.metadata["prompt_id"]))


def settings_for(size: Size, url: str, shards: int) -> Any:
    from bridge.settings import BridgeSettings

    trajectories = -(-size.in_flight // size.n_samples) * size.n_samples
    return BridgeSettings(
        url=",".join(f"{url}/s/{i}" for i in range(size.servers)), env_path="benchmarks.scale.sharded",
        n_samples_per_prompt=size.n_samples, target_groups=size.target_groups, partial_rollout=True,
        over_sampling=size.over_sampling, in_flight="fixed", max_inflight=trajectories, max_generating=trajectories,
        max_env_steps=trajectories, policy="oldest", max_staleness=1, on_stale="restart", max_turns=size.max_turns,
        max_tokens=size.max_tokens, max_new_tokens=size.max_new_tokens, shards=shards,
        ray_actor=f"turnstile-scale-{os.getpid()}",
    )  # fmt: skip


def run_sharded(size: Size, url: str, shards: int) -> dict[str, Any]:
    """The workload through `shards` shards for `size.duration_s`, a weight update every `size.update_every_s`."""
    import ray

    from bridge.convert import sample_class
    from bridge.shards import ray_shards

    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # benchmarks.* in the actors
    ray.init(
        num_cpus=max(os.cpu_count() or 1, shards), include_dashboard=False, namespace="turnstile",
        log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
    )  # fmt: skip
    control = httpx2.Client(base_url=url, trust_env=False, timeout=120)
    control.post("/sim/reset", json={"weight_version": "v0"}).raise_for_status()
    workload, cls, taken = Workload("scale", env_median_s=size.env_median_s), sample_class(), 0

    def prompts(n: int) -> list[list[Any]]:
        nonlocal taken
        rows, taken = workload.rows(n, start=taken), taken + n
        return [
            [cls(group_index=r["metadata"]["prompt_id"], index=r["metadata"]["prompt_id"] * size.n_samples + k,
                 prompt=r["prompt"], metadata=dict(r["metadata"])) for k in range(size.n_samples)]
            for r in rows
        ]  # fmt: skip

    service = ray_shards(settings_for(size, url, shards), SimpleNamespace(max_turns=size.max_turns, scale_size=size))
    statuses: dict[str, int] = {}
    trained = steps = updates = 0
    try:
        control.post("/stats/reset").raise_for_status()
        before = service.status()["shards"]
        started, cpu_started = time.monotonic(), time.process_time()
        updated = started
        while time.monotonic() - started < size.duration_s:
            out = service.rollout(steps, size.target_groups, prompts(service.wanted(size.target_groups)))
            steps += 1
            for sample in (s for group in out.samples for s in group):
                status = str(sample.status.value)
                statuses[status] = statuses.get(status, 0) + 1
                trained += 0 if status == "failed" else int(sum(sample.loss_mask or ()))
            if time.monotonic() - updated >= size.update_every_s:
                updates += 1
                service.pause()
                for i in range(size.servers):
                    body = {"model_path": "/sim/weights", "weight_version": f"v{updates}"}
                    control.post(f"/s/{i}/update_weights_from_disk", json=body).raise_for_status()
                service.resume(f"v{updates}")
                updated = time.monotonic()
        wall, cpu = time.monotonic() - started, time.process_time() - cpu_started
        after = service.status()["shards"]
        fleet = control.get("/stats").raise_for_status().json()
    finally:
        service.shutdown()
        control.close()
        ray.shutdown()
    fleet.pop("per_server", None)
    turns = fleet["num_requests"]
    return {
        "shards": shards,
        "trained_tokens_per_s": trained / wall,
        "utilization": fleet["utilization"],
        "busy_fraction": fleet["busy_fraction"],
        "mean_batch_size": fleet["mean_batch_size"],
        "share_of_ceiling": fleet["generated_tokens"] / wall / fleet_ceiling(size),
        "turns_per_s": turns / wall,
        **cpu_per_turn(cpu, before, after, turns),
        "wall_seconds": wall,
        "steps": steps,
        "num_weight_updates": updates,
        "statuses": statuses,
        "fleet": fleet,
    }
