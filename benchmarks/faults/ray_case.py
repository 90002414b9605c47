"""The fault suite's Ray cases: the rollout service (bridge/service.py) in a named Ray actor (bridge/ray_actor.py),
driven step by step as slime's generate_rollout drives it through one handle (as slime keeps it on its args),
and killed between steps FAULT_STEP and FAULT_STEP + 1; the handle's next call creates it again by name. With
`case.shards`, the rollout runs on that many such actors behind one ShardedService (bridge/shards.py), and the shard
holding the most groups is killed once step FAULT_STEP + 1 has begun on it: the step goes on, and the shard's handle
creates it again, queues what it held and begins the step there again.

The actor holds every prompt it was given and has not returned (paused trajectories with their envs, groups
done and waiting, prompts queued) in its memory; the caller's handle (bridge/ray_actor.py's RayService) keeps
those groups too, and hands them to the new actor. A prompt held when the actor was killed and not held by the
new one is counted in `lost_at_actor_restart`; the case's `lost` says whether every prompt came back. The env
is the workload's (benchmarks/faults/env.py) with the env's reward.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from functools import partial
from types import SimpleNamespace
from typing import Any

import anyio

from benchmarks.faults.cases import FAULT_STEP, STEP_TIMEOUT_S, Case, CaseRun, Outcome, failure_record
from benchmarks.faults.env import ARGS_KEY
from benchmarks.faults.servers import REPO

ACTOR_GONE_TIMEOUT_S = 30.0


async def run_ray_case(suite: Any, case: Case) -> CaseRun:
    """`case` on the rollout service in Ray; `suite` is the running Suite (suite.py): its size, workload, sampling,
    servers (the primary one started) and seed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return CaseRun(case.name, skipped="ray is not installed here (it is part of the dev extra)")
    return await anyio.to_thread.run_sync(_run, suite, case)


class DataSource:
    """slime's data source shape: get_samples(n) -> n groups of Samples, the workload's prompts in order."""

    def __init__(self, suite: Any):
        from bridge.convert import sample_class

        self.suite, self.cls, self.taken = suite, sample_class(), []

    def get_samples(self, num: int) -> list[list[Any]]:
        n = self.suite.size.n_samples
        groups = []
        for row in self.suite.workload.rows(max(0, num), start=len(self.taken)):
            i = row["metadata"]["prompt_id"]
            self.taken.append(i)
            groups.append(
                [
                    self.cls(group_index=i, index=i * n + k, prompt=row["prompt"], metadata=dict(row["metadata"]))
                    for k in range(n)
                ]
            )
        return groups


def outcome_of_sample(sample: Any) -> Outcome:
    status = str(sample.status.value)
    meta = sample.metadata or {}
    errors = meta.get("errors") or []
    error_class = errors[-1].split(":", 1)[0].split("/")[-1] if errors and status == "failed" else None
    trained = 0 if status == "failed" else int(sum(sample.loss_mask or []))
    return Outcome(status, meta.get("stop_reason"), error_class, dict(meta.get("retries") or {}), trained,
                   int(sample.group_index))  # fmt: skip


def _run(suite: Any, case: Case) -> CaseRun:
    import ray

    from bridge.ray_actor import NAMESPACE, attach_or_create
    from bridge.settings import BridgeSettings
    from engine.scheduler.retry import RetryPolicy

    size, server, run = suite.size, suite.primary, CaseRun(case.name)
    anyio.from_thread.run(partial(suite.servers.reset, server, seed=suite.seed))  # this runs in a worker thread
    workload = replace(suite.workload, reward_source="env")  # the bridge scores by the env's reward
    settings = BridgeSettings(
        n_samples_per_prompt=size.n_samples, target_groups=size.target_groups, partial_rollout=True,
        over_sampling=size.over_sampling, in_flight="fixed", max_turns=workload.max_turns,
        env_path="benchmarks.faults.env",
        url=server.url, max_tokens=size.max_tokens, sampling=suite.sampling, max_generating=size.server.max_running,
        max_inflight=math.ceil(size.target_groups * size.over_sampling) * size.n_samples,
        max_env_steps=size.max_env_steps, policy=size.scheduling, retry=RetryPolicy(env_step_timeout_s=STEP_TIMEOUT_S),
    )  # fmt: skip
    env_args = SimpleNamespace(
        max_turns=workload.max_turns,
        custom_rm_path="benchmarks.faults.env.reward",
        **{ARGS_KEY: {f: getattr(workload, f) for f in workload.__dataclass_fields__}},
    )
    started_ray = not ray.is_initialized()
    if started_ray:
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # benchmarks.* in the actor
        ray.init(
            num_cpus=2, include_dashboard=False, namespace=NAMESPACE, ignore_reinit_error=True, log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )  # fmt: skip
    name = f"turnstile-faults-{os.getpid()}"
    if case.shards:
        settings = settings.model_copy(update={"shards": case.shards, "ray_actor": name})
    run.notes.append(
        "this case runs the rollout service in a Ray actor (the bridge's path), the others an engine in process: "
        "against `none`, its throughput and step times include Ray's calls and the new actor's start (restart_s)"
    )
    source = DataSource(suite)
    service = None
    try:
        if case.shards:
            from bridge.shards import ray_shards

            service = ray_shards(settings, env_args)
        else:
            service = attach_or_create(name, settings, env_args)
        started = time.monotonic()
        for step in range(size.num_steps):
            groups = source.get_samples(service.wanted(size.target_groups))
            if case.shards and step == FAULT_STEP + 1:
                killing = _kill_a_shard_once_begun(ray, service)
            begun = time.monotonic()
            out = service.rollout(step, size.target_groups, groups)
            run.step_seconds.append(time.monotonic() - begun)
            run.returned.append([outcome_of_sample(s) for group in out.samples for s in group])
            run.returned_prompts += [int(group[0].group_index) for group in out.samples]
            if case.shards and step == FAULT_STEP + 1:
                now_held = set(service.held_prompts()) | set(run.returned_prompts)
                run.lost_at_restart = [int(i) for i in killing["held"] if i is not None and i not in now_held]
                run.actions.append({
                    "action": "kill the rollout shard holding most groups once the step has begun on it",
                    "during_step": step, "held_when_killed": len(killing["held"]),
                    "restarts": killing["victim"].restarts,
                })  # fmt: skip
            service.pause()
            version = f"v{step + 1}"
            anyio.from_thread.run(suite.servers.update_weights, server, version)
            if step == FAULT_STEP and not case.shards:
                held = service.held_prompts()
                killed = time.monotonic()
                ray.kill(service._actor, no_restart=True)
                _wait_gone(ray, name, NAMESPACE)
                service.num_held()  # the next call finds the actor dead, creates it again, hands it what it held
                run.lost_at_restart = [int(i) for i in held if i is not None and i not in service.held_prompts()]
                run.actions.append({
                    "action": "kill the rollout service's Ray actor; the next call creates it again",
                    "after_step": step,
                    "held_when_killed": len(held), "restart_s": round(time.monotonic() - killed, 2),  # until it answers
                    "restarts": service.restarts,
                })  # fmt: skip
            if step + 1 < size.num_steps:
                service.resume(version)
        run.wall_seconds = time.monotonic() - started
        run.held_prompts = [int(i) for i in service.held_prompts() if i is not None]
        status = service.status()
        run.engine = {"status": status}
    except Exception as exc:  # noqa: BLE001 -- recorded; the suite goes on
        run.failure = failure_record("step_error", exc, step=len(run.step_seconds), where="ray service")
        run.wall_seconds = run.wall_seconds or sum(run.step_seconds)
    finally:
        run.taken = list(source.taken)
        if service is not None:
            try:
                service.shutdown()
            except Exception as exc:  # noqa: BLE001
                run.notes.append(f"shutting the actor down failed: {exc!r}")
        if started_ray:
            ray.shutdown()
    return run


def _kill_a_shard_once_begun(ray: Any, service: Any) -> dict[str, Any]:
    """Arm the kill: the shard holding the most groups dies right after the next step begins on it. What it held
    then, and the shard, are in the returned dict once it has."""
    victim = max(service.shards, key=lambda shard: shard.num_held())
    killing: dict[str, Any] = {"victim": victim, "held": []}
    begin = victim.begin

    def begin_then_die(*args: Any) -> None:
        begin(*args)
        killing["held"] = victim.held_prompts()
        ray.kill(victim._actor, no_restart=True)
        victim.begin = begin  # once

    victim.begin = begin_then_die
    return killing


def _wait_gone(ray: Any, name: str, namespace: str) -> None:
    """Until the killed actor's name is free (ray.kill returns before the actor is gone); bounded."""
    deadline = time.monotonic() + ACTOR_GONE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)  # Ray gives no event for an actor's end
    raise TimeoutError(f"the killed actor {name!r} was still registered after {ACTOR_GONE_TIMEOUT_S:g} s")
