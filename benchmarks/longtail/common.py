"""What the long-tail policies share: their setup, the timing wrappers, and the metrics of a run.

Every policy talks to the simulated server through the same `SGLangBackend`, wrapped in a
`TimedBackend` that notes when each generate call started and ended, and steps the same env, wrapped
in a `TimedEnv` that notes its resets and steps. With the reward from a reward function (the
workload's `reward_source="rm"`), every policy scores with the same `RewardModel`, which notes each
call, and each policy notes when every trajectory ended and when it was settled (scored, or ended
unscored) in a `RewardLog`. The timeline plot is rebuilt from those notes after the run: a call is
matched to its trajectory by the input length and last tokens it was sent (one call per
`Trajectory.spans` entry), an env by the model's first response it answered.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import numpy as np

from benchmarks.longtail.workload import Workload
from engine.backends.base import GenerateResult, SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.encoding import ChatEncoder
from engine.envs.base import BaseInteractionEnv
from engine.metrics.events import Observer
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits

TAIL = 24  # tokens of an input that name a generate call, with its length


def version_index(version: str | None) -> int | None:
    """The index of a simulated server's version: v0, v1, v2, ... (None for anything else)."""
    digits = (version or "").lstrip("v")
    return int(digits) if digits.isdigit() else None


@dataclass(slots=True)
class CallRecord:
    first_token: int | None
    started: float
    ended: float  # when the caller got the reply: later than the server's answer if its event loop was busy
    server_seconds: float  # the server's e2e_latency
    num_tokens: int
    finish_reason: str


class TimedBackend:
    """An SGLangBackend that notes every generate call; everything else is passed through."""

    def __init__(self, backend: SGLangBackend):
        self.inner = backend
        self.calls: dict[tuple[int, int], list[CallRecord]] = defaultdict(list)

    async def generate(
        self, input_ids: Sequence[int], sampling_params: SamplingParams, image_data=None, *, rid=None, session_id=None
    ):
        started = time.monotonic()
        result: GenerateResult = await self.inner.generate(
            input_ids, sampling_params, image_data, rid=rid, session_id=session_id
        )
        ended = time.monotonic()
        first = result.token_ids[0] if result.token_ids else None
        server_seconds = min(float(result.meta.get("e2e_latency") or ended - started), ended - started)
        record = CallRecord(first, started, ended, server_seconds, len(result.token_ids), result.finish_reason)
        self.calls[(len(input_ids), hash(tuple(input_ids[-TAIL:])))].append(record)
        return result

    def __getattr__(self, name: str) -> Any:  # abort, pause, resume, weight_version, health, ...
        return getattr(self.inner, name)


@dataclass(slots=True)
class EnvRecord:
    reset: float
    steps: list[tuple[float, float, bool]] = field(default_factory=list)  # start, end, succeeded


class TimedEnv(BaseInteractionEnv):
    """An env that notes its reset and each step; filed under the first response it answered."""

    def __init__(self, env: BaseInteractionEnv, log: dict[int, EnvRecord], lock: threading.Lock):
        self.env, self._log, self._lock = env, log, lock
        self.replay_safe = env.replay_safe
        self._record: EnvRecord | None = None

    def reset(self):
        self._record = EnvRecord(time.monotonic())
        return self.env.reset()

    def step(self, response_text: str):
        record = self._record if self._record is not None else EnvRecord(time.monotonic())
        if not record.steps:
            with self._lock:
                self._log[hash(response_text)] = record
        started, ok = time.monotonic(), False
        try:
            result = self.env.step(response_text)
            ok = True
            return result
        finally:
            record.steps.append((started, time.monotonic(), ok))

    def close(self) -> None:
        self.env.close()

    def format_observation(self, observation):
        return self.env.format_observation(observation)


@dataclass
class RewardLog:
    """Per trajectory id: when its rollout ended (its first reward call began, if it had one), when it
    was settled (scored, or ended unscored: from then on its group can be returned), and its reward
    calls (start, end)."""

    ended: dict[int, float] = field(default_factory=dict)
    settled: dict[int, float] = field(default_factory=dict)
    calls: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))

    def note_settled(self, trajectory: Trajectory) -> None:
        now = time.monotonic()
        self.ended.setdefault(trajectory.id, now)
        self.settled[trajectory.id] = now


class SettledObserver(Observer):
    """Notes when the engine is done with each trajectory (`trajectory_ended` follows its scoring)."""

    def __init__(self, log: RewardLog):
        self.log = log

    def trajectory_ended(self, trajectory: Trajectory) -> None:
        self.log.note_settled(trajectory)


class RewardModel:
    """The workload's reward function, called with an ended trajectory, as slime's reward path scores a
    sample: with `reward_latency_s` > 0 a remote reward model (an async call that answers after that
    long), with 0 a rule-based one (a plain call). Its value is what the env would have reported
    (`Workload.reward` on the model's first response) for a trajectory the env ended, and 0.0 for one a
    budget cut short (not solved). Every call is noted in `log`."""

    def __init__(self, workload: Workload, encoder: ChatEncoder, log: RewardLog):
        self.workload, self.encoder, self.log = workload, encoder, log

    def __call__(self, trajectory: Trajectory) -> Any:
        if self.workload.reward_latency_s > 0:
            return self._remote(trajectory)
        started = time.monotonic()
        try:
            return self._value(trajectory)
        finally:
            self._note(trajectory, started)

    async def _remote(self, trajectory: Trajectory) -> float:
        started = time.monotonic()
        try:
            await anyio.sleep(self.workload.reward_latency_s)
            return self._value(trajectory)
        finally:
            self._note(trajectory, started)

    def _value(self, trajectory: Trajectory) -> float:
        if trajectory.stop_reason is not StopReason.ENV_DONE or not trajectory.turns:
            return 0.0
        first = self.encoder.response_text(trajectory.generated_ids(trajectory.turns[0]).tolist())
        return self.workload.reward(trajectory.metadata, first)

    def _note(self, trajectory: Trajectory, started: float) -> None:
        self.log.ended.setdefault(trajectory.id, started)
        self.log.calls[trajectory.id].append((started, time.monotonic()))


@dataclass
class Setup:
    """One workload on one server, as every policy of a run sees it."""

    backend: TimedBackend
    encoder: ChatEncoder
    workload: Workload
    sampling: SamplingParams
    limits: TurnLimits
    n_samples: int
    num_steps: int
    target_groups: int
    concurrency: int  # generation slots (Turnstile) = the concurrency semaphore (slime-style)
    max_env_steps: int
    over_sampling: float
    refill: float = 0.0
    max_staleness: int = 1
    scheduling: str = "group_completion"
    gc_freeze: bool = True  # Turnstile's EngineConfig.gc_freeze
    server_url: str = ""
    env_log: dict[int, EnvRecord] = field(default_factory=dict)
    env_lock: threading.Lock = field(default_factory=threading.Lock)
    rewards: RewardLog = field(default_factory=RewardLog)

    async def server_stats(self) -> dict[str, Any]:
        """The simulated server's measurements since its last /stats/reset."""
        async with httpx2.AsyncClient(base_url=self.server_url, trust_env=False) as client:
            return (await client.get("/stats")).raise_for_status().json()

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every policy draws the same prompts in the same order."""
        return (self.workload.rows(1, start=i)[0] for i in itertools.count())

    def make_env(self, row_or_sample: Any) -> TimedEnv:
        return TimedEnv(self.workload.build_env(row_or_sample), self.env_log, self.env_lock)

    def reward_model(self) -> RewardModel | None:
        """The reward function every policy scores with; None when the env reports the reward."""
        if self.workload.reward_source == "env":
            return None
        return RewardModel(self.workload, self.encoder, self.rewards)

    def reset_records(self) -> None:
        self.backend.calls.clear()
        self.env_log.clear()
        self.rewards = RewardLog()


@dataclass
class PolicyRun:
    """What a policy did: per step, the trajectories handed to the trainer and the version it was at."""

    name: str
    returned: list[list[Trajectory]] = field(default_factory=list)
    trainer_versions: list[str] = field(default_factory=list)
    step_times: list[tuple[float, float]] = field(default_factory=list)  # monotonic start, end of each step
    started: float = 0.0
    wall_seconds: float = 0.0
    unfinished: list[Trajectory] = field(default_factory=list)  # held (paused, or done and not yet returned)
    submitted: dict[int, float] = field(default_factory=dict)  # trajectory id -> when it was handed out, if known
    server: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    rewards: RewardLog = field(default_factory=RewardLog)
    collector: dict[str, Any] = field(default_factory=dict)  # CollectorPauses.summary() of the run


class CollectorPauses:
    """The garbage collector's passes in this process while it is entered, timed from gc.callbacks: each pass stops
    the event loop (and every thread) for as long as it runs. Generation 2 is a full pass."""

    def __init__(self) -> None:
        self.seconds: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started: float | None = None  # None until a pass starts after entering

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds[info["generation"]].append(time.perf_counter() - self._started)

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        every = [s for passes in self.seconds.values() for s in passes]
        return {
            "passes": len(every),
            "seconds": round(sum(every), 3),
            "full_passes_ms": [round(s * 1000, 1) for s in self.seconds[2]],
        }


def model_tokens(trajectory: Trajectory) -> int:
    return sum(trajectory.loss_mask)


def summarize(run: PolicyRun) -> dict[str, Any]:
    """The report's numbers for one policy (see benchmarks/longtail/run.py for their definitions)."""
    staleness: Counter[int | str] = Counter()
    statuses: Counter[str] = Counter()
    trained = num_turns = num_trajectories = 0
    for trajectories, version in zip(run.returned, run.trainer_versions, strict=True):
        now = version_index(version)
        for t in trajectories:
            statuses[str(t.status)] += 1
            num_trajectories += 1
            num_turns += len(t.turns)
            if t.status is Status.FAILED:
                continue
            for span in t.spans:
                n = sum(t.loss_mask[span.start : span.start + span.length])
                made = version_index(span.weight_version)
                staleness[now - made if now is not None and made is not None else "unknown"] += n
                trained += n
    generated = int(run.server.get("generated_tokens", 0))
    unfinished = sum(model_tokens(t) for t in run.unfinished)
    discarded = max(0, generated - trained - unfinished)
    steps = [end - start for start, end in run.step_times]
    stale_le1 = sum(n for age, n in staleness.items() if isinstance(age, int) and age <= 1)
    return {
        "trained_tokens_per_s": trained / run.wall_seconds if run.wall_seconds else 0.0,
        "step_seconds_p50": float(np.percentile(steps, 50)) if steps else 0.0,
        "step_seconds_p99": float(np.percentile(steps, 99)) if steps else 0.0,
        "backend_utilization": float(run.server.get("utilization", 0.0)),
        "backend_busy_fraction": float(run.server.get("busy_fraction", 0.0)),
        "mean_batch_size": float(run.server.get("mean_batch_size", 0.0)),
        "discarded_token_fraction": discarded / generated if generated else 0.0,
        "unfinished_token_fraction": unfinished / generated if generated else 0.0,
        "stale_le1_fraction": stale_le1 / trained if trained else 0.0,
        "staleness_histogram": {str(k): v for k, v in sorted(staleness.items(), key=lambda kv: str(kv[0]))},
        "trained_tokens": trained,
        "generated_tokens": generated,
        "discarded_tokens": discarded,
        "unfinished_tokens": unfinished,
        "wall_seconds": run.wall_seconds,
        "num_steps": len(steps),
        "step_seconds": steps,
        "num_trajectories": num_trajectories,
        "statuses": dict(statuses),
        "mean_turns": num_turns / num_trajectories if num_trajectories else 0.0,
        **reward_figures(run, steps),
        "collector_pauses": run.collector,
        "server": run.server,
        "engine": run.engine,
    }


def reward_figures(run: PolicyRun, steps: list[float]) -> dict[str, Any]:
    """What the reward path cost (see benchmarks/longtail/run.py): its calls, the seconds in them, and the
    wait it put on each returned group and on each step's end."""
    log = run.rewards
    durations = [end - start for calls in log.calls.values() for start, end in calls]
    waits, tails = [], []
    for trajectories in run.returned:
        groups: dict[int, list[Trajectory]] = defaultdict(list)
        for t in trajectories:
            groups[t.group_id].append(t)
        step: list[tuple[float, float]] = []
        for members in groups.values():
            times = [(log.ended[t.id], log.settled[t.id]) for t in members if t.id in log.settled]
            if times:  # the group was ready once its last member settled; its last member ended before
                waits.append(max(s for _, s in times) - max(e for e, _ in times))
                step += times
        if step:
            tails.append(max(s for _, s in step) - max(e for e, _ in step))
    num_steps = max(len(steps), 1)
    return {
        "reward_calls": len(durations),
        "reward_seconds": float(sum(durations)),
        "reward_seconds_per_call": float(np.mean(durations)) if durations else 0.0,
        "reward_seconds_per_step": float(sum(durations)) / num_steps,
        "reward_group_wait_seconds_mean": float(np.mean(waits)) if waits else 0.0,
        "reward_group_wait_seconds_p99": float(np.percentile(waits, 99)) if waits else 0.0,
        "reward_tail_seconds": float(sum(tails)),
        "reward_tail_seconds_per_step": float(sum(tails)) / num_steps,
        "reward_tail_fraction": float(sum(tails)) / sum(steps) if sum(steps) else 0.0,
    }


def build_timeline(run: PolicyRun, setup: Setup, *, step: int, max_lanes: int = 24) -> list[dict[str, Any]]:
    """Lanes for a sample of the trajectories returned at `step`: their generate calls and env steps,
    in seconds from the policy's start. A lane runs from when the trajectory was handed out (else its env
    reset, else its first call) to its last event (its reward call included); a generate call counts
    from its sending until the server answered."""
    chosen = sorted(run.returned[step], key=_last_event_key(setup))
    if len(chosen) > max_lanes:  # evenly through the finishing order, the slowest included
        chosen = [chosen[round(i * (len(chosen) - 1) / (max_lanes - 1))] for i in range(max_lanes)]
    step_start, step_end = (x - run.started for x in run.step_times[step])
    lanes = []
    for t in chosen:
        generate, env, reset = _events(t, setup)
        reward = run.rewards.calls.get(t.id, [])
        times = [s for s, _ in generate + env + reward] + [e for _, e in generate + env + reward]
        if not times:
            continue
        start = run.submitted.get(t.id) or min(times + ([reset] if reset is not None else []))
        lanes.append(
            {
                "trajectory": t.id,
                "group": t.group_id,
                "status": str(t.status),
                "start": start - run.started,
                "end": max(times) - run.started,
                "generate": [(s - run.started, e - run.started) for s, e in generate],
                "env": [(s - run.started, e - run.started) for s, e in env],
                "reward": [(s - run.started, e - run.started) for s, e in reward],
                "step": (step_start, step_end),
            }
        )
    return lanes


def _events(t: Trajectory, setup: Setup) -> tuple[list, list, float | None]:
    tokens = t.tokens
    generate = []
    for span in t.spans:
        n = t.prompt_length + span.start
        first = tokens[n] if span.length else None
        for record in setup.backend.calls.get((n, hash(tuple(tokens[max(0, n - TAIL) : n]))), ()):
            if record.first_token == first:  # the rest of the call's time its reply waited for the caller
                generate.append((record.started, record.started + record.server_seconds))
    env: list[tuple[float, float]] = []
    reset = None
    if t.turns:
        text = setup.encoder.response_text(t.generated_ids(t.turns[0]).tolist())
        record = setup.env_log.get(hash(text))
        if record is not None:
            reset = record.reset
            env = [(s, e) for s, e, _ in record.steps]
    return generate, env, reset


def _last_event_key(setup: Setup) -> Callable[[Trajectory], float]:
    def key(t: Trajectory) -> float:
        generate, env, _ = _events(t, setup)
        return max((e for _, e in generate + env), default=0.0)

    return key
