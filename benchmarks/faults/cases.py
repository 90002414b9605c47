"""The fault suite's cases and what a run of one yields, shared by the suite (suite.py), its Ray cases (ray_case.py)
and its report (report.py), and importing none of them: the constants the cases share, `Case` and the table of
`CASES`, what a case run collects (`CaseRun`, one `Outcome` per trajectory handed back, `failure_record` for what
went wrong), and each case's entry in report.json (`summarize`) and row of the printed table (`HEADER`, `line`).
suite.py's docstring says what each case does and what the report holds.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import numpy as np

from benchmarks.agents.farm import AgentFaults, AgentPlan
from engine.engine import RolloutEngine
from engine.envs.faults import FaultSpec
from engine.scheduler.retry import RetryPolicy

STEP_TIMEOUT_S = 1.5  # the env step timeout (the env's slowest step: 30 x its 30 ms median)
HANG_S = 3 * STEP_TIMEOUT_S  # a hung env step returns after this long (the engine has given up on it by then)
FAULT_STEP = 1  # the Ray actor is killed after this step
KILL_FROM, KILL_TO = 0.3, 0.6  # processes are killed mid-step, between these shares of the `none` case's calls
AGENT_DEADLINE_S = 10.0  # an agent's deadline in the agent cases (the slowest of `agents_none` takes a few seconds)
AGENT_PLAN = AgentPlan(max_requests=6, tool_median_s=0.05, tool_max_s=0.5)  # the agent cases': short sessions


@dataclass(frozen=True)
class Case:
    """One run of the workload with some faults. See suite.py's docstring."""

    name: str
    what: str
    env: FaultSpec | None = None  # faults injected into every env
    subprocess_envs: bool = False  # every env runs in a child process (SubprocessEnv)
    replay_safe_envs: bool = False  # ... declared replay safe: a new child is started and replayed into
    kill_envs: int = 0  # env processes SIGKILLed mid-step
    reward_error_rate: float = 0.0
    server_faults: dict[str, float] = field(default_factory=dict)  # the simulated server's /sim/faults
    restart_server: bool = False  # the server SIGKILLed mid-step and started again on its port
    topology: str = "single"  # single | router (two servers behind sglang-router) | pool (two in a BackendPool)
    kill_worker: bool = False  # the second of two servers SIGKILLed mid-step, for good
    ray: bool = False  # the rollout service in a Ray actor, killed and created again between steps
    shards: int = 0  # with ray: the rollout on this many shards (bridge/shards.py), one killed mid-step
    agents: AgentFaults | None = None  # agent programs through the gateway instead of the workload's envs


CASES = (
    Case("none", "no faults: the baseline"),
    Case("env_exception_1pct", "1% of env steps raise", env=FaultSpec(exception=0.01)),
    Case("env_exception_10pct", "10% of env steps raise", env=FaultSpec(exception=0.10)),
    Case(
        "env_exception_10pct_replay_safe",
        "10% of env steps raise; the env declared replay safe (the engine may reset it, replay, retry)",
        env=FaultSpec(exception=0.10, replay_safe=True),
    ),
    Case(
        "env_hang",
        f"2% of env steps hang for {HANG_S:g} s, past the {STEP_TIMEOUT_S:g} s step timeout",
        env=FaultSpec(hang=0.02, hang_s=HANG_S),
    ),
    Case(
        "env_hang_replay_safe",
        f"2% of env steps hang for {HANG_S:g} s; the env declared replay safe",
        env=FaultSpec(hang=0.02, hang_s=HANG_S, replay_safe=True),
    ),
    Case(
        "env_malformed",
        "1% of env steps return no (obs, done, info) triple, 1% an observation that is not a dict",
        env=FaultSpec(malformed_return=0.01, malformed_observation=0.01),
    ),
    Case(
        "env_malformed_content",
        "2% of env steps return a dict observation whose obs_str is not text",
        env=FaultSpec(malformed_content=0.02),
    ),
    Case(
        "env_process_killed",
        "envs in child processes (not replay safe); 3 SIGKILLed mid-step",
        subprocess_envs=True,
        kill_envs=3,
    ),
    Case(
        "env_process_killed_replay_safe",
        "envs in child processes declared replay safe; 3 SIGKILLed mid-step",
        subprocess_envs=True,
        replay_safe_envs=True,
        kill_envs=3,
    ),
    Case("reward_error", "10% of reward calls raise", reward_error_rate=0.10),
    Case("server_5xx", "5% of /generate requests answered HTTP 503", server_faults={"error_rate": 0.05}),
    Case(
        "server_malformed",
        "3% of /generate replies malformed (after generating)",
        server_faults={"malformed_rate": 0.03},
    ),
    Case("server_restart", "the server SIGKILLed mid-step and started again on its port", restart_server=True),
    Case(
        "router_worker_dies",
        "two servers behind sglang-router (consistent hashing); one SIGKILLed mid-step, for good",
        topology="router",
        kill_worker=True,
    ),
    Case(
        "pool_worker_dies",
        "two servers in a BackendPool (no router); one SIGKILLed mid-step, for good",
        topology="pool",
        kill_worker=True,
    ),
    Case(
        "ray_actor_restart",
        "the rollout service's Ray actor killed between steps 1 and 2, then created again",
        ray=True,
    ),
    Case(
        "ray_shard_killed",
        "the rollout on two shards (Ray actors); the one holding most groups killed once step 2 has begun on it, "
        "then created again",
        ray=True,
        shards=2,
    ),
    Case(
        "agents_none",
        "agent programs (benchmarks/agents/farm.py, the `openai` SDK) through the session gateway, no faults: the "
        "agent cases' baseline",
        agents=AgentFaults(),
    ),
    Case("agent_crash", "20% of agents raise partway (before one of their requests)", agents=AgentFaults(crash=0.2)),
    Case(
        "agent_hang",
        f"10% of agents stop partway and never ask again, until their {AGENT_DEADLINE_S:g} s deadline",
        agents=AgentFaults(hang=0.1),
    ),
    Case(
        "agent_malformed_requests",
        "20% of requests preceded by a malformed one (not JSON, n=2, a tool result for no call, an unknown session)",
        agents=AgentFaults(malformed=0.2),
    ),
    Case(
        "agent_disconnect",
        "20% of requests first sent streaming, the stream left after its first chunk, then sent again",
        agents=AgentFaults(disconnect=0.2),
    ),
    Case(
        "all",
        "all at once: env exceptions 1%, hangs 1%, malformed 1.5%; env processes (2 killed); reward errors 5%; "
        "server 5xx 2%, malformed 1%; the server killed and restarted",
        env=FaultSpec(
            exception=0.01,
            hang=0.01,
            hang_s=HANG_S,
            malformed_return=0.005,
            malformed_observation=0.005,
            malformed_content=0.005,
        ),
        subprocess_envs=True,
        kill_envs=2,
        reward_error_rate=0.05,
        server_faults={"error_rate": 0.02, "malformed_rate": 0.01},
        restart_server=True,
    ),  # fmt: skip
)
CASE_NAMES = tuple(case.name for case in CASES)
BY_NAME = {case.name: case for case in CASES}


# -- what a case run collects ------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One trajectory handed back: what the report counts of it."""

    status: str
    stop_reason: str | None
    error_class: str | None  # of the error that ended a failed one
    retries: dict[str, int]
    trained_tokens: int  # loss mask 1, when it did not fail
    prompt_id: int


@dataclass
class CaseRun:
    name: str
    taken: list[int] = field(default_factory=list)  # prompt ids taken from the source, in order
    returned: list[list[Outcome]] = field(default_factory=list)  # per step, per trajectory
    returned_prompts: list[int] = field(default_factory=list)  # one per returned group
    held_prompts: list[int] = field(default_factory=list)
    dropped: int = 0
    step_seconds: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    calls_per_step: list[int] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    injected: dict[str, Any] = field(default_factory=dict)
    actions: list[dict[str, Any]] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    steps_refused: list[dict[str, Any]] = field(default_factory=list)  # steps the engine refused to train on
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    lost_at_restart: list[int] | None = None  # the Ray case: prompts held when its actor was killed, gone after


def outcome_of(trajectory: Any, prompt_id: int, trains: bool = True) -> Outcome:
    """`trains`: the step it came back in goes to training (a step refused for its failures does not)."""
    status = str(trajectory.status)
    error = trajectory.errors[-1].error_class if trajectory.errors and status == "failed" else None
    trained = 0 if status == "failed" or not trains else int(sum(trajectory.loss_mask))
    return Outcome(
        status,
        None if trajectory.stop_reason is None else str(trajectory.stop_reason),
        None if error is None else str(error),
        dict(trajectory.metadata.get("retries") or {}),
        trained,
        prompt_id,
    )


def failure_record(kind: str, exc: BaseException | None, **extra: Any) -> dict[str, Any]:
    """What went wrong: the innermost exception (not a cancellation) and the head of its traceback."""
    record: dict[str, Any] = {"kind": kind, **extra}
    leaf = _leaf(exc) if exc is not None else None
    if leaf is not None:
        lines = "".join(traceback.format_exception(leaf)).rstrip().splitlines()
        record["error"] = f"{type(leaf).__name__}: {leaf}"
        record["traceback_head"] = lines[-14:]
    return record


def _leaf(exc: BaseException) -> BaseException:
    if isinstance(exc, BaseExceptionGroup):
        leaves = [_leaf(e) for e in exc.exceptions]
        real = [e for e in leaves if not isinstance(e, anyio.get_cancelled_exc_class())]
        return (real or leaves)[0]
    return exc


def engine_figures(engine: RolloutEngine) -> dict[str, Any]:
    stats = engine.statistics()
    s = stats.scheduler
    return {
        "num_prompts_admitted": stats.num_prompts_admitted,
        "num_groups_returned": stats.num_groups_returned,
        "num_groups_open": stats.num_groups_open,
        "num_groups_done": stats.num_groups_done,
        "num_trajectories_inflight": stats.num_trajectories_inflight,
        "retries": {str(k): v for k, v in s.retries.items()},
        "budgets_exhausted": {str(k): v for k, v in s.budgets_exhausted.items()},
        "phases": {str(k): v for k, v in s.phases.items()},
        "longest_in_phase_s": {str(k): round(v, 3) for k, v in s.longest_in_phase.items()},
        "breaker": asdict(s.breaker),
        "num_paused": s.num_paused,
        "num_resumed": s.num_resumed,
        "num_restarted": s.num_restarted,
    }


# -- the report ---------------------------------------------------------------------------------------------


def summarize(case: Case, run: CaseRun, baseline: CaseRun | None, retry: RetryPolicy) -> dict[str, Any]:
    """One case's entry in report.json (see suite.py's docstring)."""
    entry: dict[str, Any] = {"what": case.what}
    if run.skipped:
        return {**entry, "skipped": run.skipped}
    outcomes = [o for step in run.returned for o in step]
    taken, returned, held = set(run.taken), Counter(run.returned_prompts), set(run.held_prompts)
    lost = sorted(taken - set(returned) - held)
    statuses = Counter(o.status for o in outcomes)
    trained = sum(o.trained_tokens for o in outcomes)
    spent_returned: Counter[str] = Counter()
    for o in outcomes:
        spent_returned.update(o.retries)
    entry["prompts"] = {
        "taken": len(taken),
        "returned": len(returned),
        "held": len(held),
        "dropped": run.dropped,
        "lost": max(0, len(lost) - run.dropped),  # a dropped group's prompt is accounted for
        "lost_ids": lost[:50],
        "returned_twice": sum(1 for n in returned.values() if n > 1),
    }
    if run.lost_at_restart is not None:  # the Ray case
        entry["prompts"]["lost_at_actor_restart"] = len(run.lost_at_restart)
    entry["trajectories"] = {
        "returned": len(outcomes),
        "by_status": dict(statuses),
        "by_stop_reason": dict(Counter(o.stop_reason for o in outcomes)),
        "failed_by_error_class": dict(Counter(o.error_class for o in outcomes if o.status == "failed")),
    }
    most = max((sum(o.retries.values()) for o in outcomes), default=0)
    entry["retries"] = {
        "spent_by_class": run.engine.get("retries", {}),
        "spent_in_returned": dict(spent_returned),
        "budgets_exhausted": run.engine.get("budgets_exhausted", {}),
        "budget_per_turn": {str(k): v for k, v in retry.per_turn.items()},
        "budget_per_trajectory": retry.per_trajectory,
        "most_by_one_trajectory": most,
    }
    steps = run.step_seconds
    tps = trained / run.wall_seconds if run.wall_seconds else 0.0
    entry["throughput"] = {"trained_tokens": trained, "trained_tokens_per_s": round(tps, 1)}
    entry["steps"] = {
        "seconds": [round(s, 3) for s in steps],
        "p50_s": round(float(np.percentile(steps, 50)), 3) if steps else None,
        "mean_s": round(float(np.mean(steps)), 3) if steps else None,
        "completed": len(steps),
        "generate_calls": run.calls_per_step,
    }
    if baseline is not None and baseline is not run and baseline.step_seconds and steps:
        base = summarize_baseline(baseline)
        entry["throughput"]["relative_to_none"] = round(tps / base["tps"], 3) if base["tps"] else None
        entry["steps"]["inflation_p50"] = round(float(np.percentile(steps, 50)) / base["p50"], 3)
        entry["steps"]["inflation_mean"] = round(float(np.mean(steps)) / base["mean"], 3)
    entry["steps"]["refused"] = run.steps_refused  # too many failures: returned on the error, not trained
    entry["injected"] = run.injected
    entry["actions"] = run.actions
    entry["engine"] = {k: run.engine.get(k) for k in ("breaker", "num_paused", "num_resumed", "num_restarted")}
    entry["engine_failure"] = run.failure
    if run.notes:
        entry["notes"] = run.notes
    return entry


def summarize_baseline(run: CaseRun) -> dict[str, float]:
    outcomes = [o for step in run.returned for o in step]
    trained = sum(o.trained_tokens for o in outcomes)
    return {
        "tps": trained / run.wall_seconds if run.wall_seconds else 0.0,
        "p50": float(np.percentile(run.step_seconds, 50)),
        "mean": float(np.mean(run.step_seconds)),
    }


def line(name: str, entry: dict[str, Any]) -> str:
    """One row of the table."""
    if "skipped" in entry:
        return f"{name:31} skipped: {entry['skipped'][:80]}"
    if "suite_error" in entry:
        return f"{name:31} NOT RUN, the suite failed: {entry['suite_error'].get('error', '')[:100]}"
    p, t = entry["prompts"], entry["trajectories"]["by_status"]
    statuses = " ".join(f"{k[:4]}={v}" for k, v in sorted(t.items()))
    retries = sum(entry["retries"]["spent_by_class"].values())
    rel = entry["throughput"].get("relative_to_none")
    infl = entry["steps"].get("inflation_p50")
    failure = entry["engine_failure"]
    return (
        f"{name:31} taken {p['taken']:3} ret {p['returned']:3} held {p['held']:3} lost {p['lost']:3}  "
        f"{statuses:38} retries {retries:4}  {entry['throughput']['trained_tokens_per_s']:7.0f} tok/s"
        f"{'' if rel is None else f' ({rel:.2f}x)':9}  step p50 {entry['steps']['p50_s'] or 0:5.2f}s"
        f"{'' if infl is None else f' ({infl:.2f}x)':9}  {'' if failure is None else failure['kind'].upper()}"
    )


HEADER = (
    f"{'fault':31} {'prompts':37} {'trajectories by status':38} {'retries':12} {'throughput':20} "
    f"{'step time':24} engine"
)
