"""RolloutEngine: prompts in, groups of finished trajectories out, a turn-level scheduler in between.

    async with RolloutEngine(backend=b, encoder=e, env_factory=f, source=rows, config=EngineConfig(...)) as engine:
        groups = await engine.rollout(32)          # one step's worth: 32 groups of n_samples_per_prompt
        await engine.pause()                        # a weight update: generation stops, env steps go on
        await engine.resume("step-1")
        async for group in engine.stream(): ...     # or: groups as they finish, until the source runs dry

Each prompt row becomes a group of `n_samples_per_prompt` trajectories, emitted once every member
has ended, after an optional filter (dropped groups are counted by reason). With partial rollout a
step keeps `target * over_sampling` groups in flight (`in_flight` fixed), or as many as the servers'
own load says, at most that (`in_flight` auto, engine/scheduler/inflight.py); once `target` are done
it returns them and pauses the rest, which resume first in the next step with their envs and turn
state. With `refill`, the step's tail (fewer trajectories live than generation slots) starts up to
`target * refill` more.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from engine.backends.base import Backend, SamplingParams
from engine.config import EngineConfig
from engine.encoding import ChatEncoder
from engine.envs.base import AbandonedCalls, EnvRunner
from engine.envs.loader import EnvSample
from engine.errors import (
    BackendError,
    EnvError,
    ErrorClass,
    FilterError,
    InternalError,
    ObservationError,
    PromptError,
    RewardError,
    TurnError,
)
from engine.gc_freeze import freeze_long_lived
from engine.hosting import EnvHost, HostedEnv
from engine.metrics.events import Observer
from engine.metrics.recorder import MetricsRecorder
from engine.metrics.summary import GroupDigest, step_summary
from engine.scheduler.inflight import InFlightSizer
from engine.scheduler.partial import mask_offpolicy
from engine.scheduler.retry import CircuitBreaker, RetryBudget
from engine.scheduler.scheduler import SCORED, Scheduler, maybe_await
from engine.scheduler.signals import Broadcast
from engine.source import PromptSource, RowSource, check_row
from engine.statistics import EngineStatistics
from engine.trajectory import Group, Status, StopReason, Trajectory
from engine.turn import ServerReader, record_failure

SIZING_INTERVAL_S = 0.5  # how often a step of in_flight auto reads the servers' load

if TYPE_CHECKING:
    from engine.metrics.prometheus import MetricsExporter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A group filter's answer (slime's DynamicFilterOutput): keep the group, or drop it for `reason`;
    `keep_when_insufficient` keeps a dropped group when the step could not be filled without it, or once the
    step has dropped its over-sampling margin (slime: no second sampling round for such a group)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


class StepFailedError(RuntimeError):
    """A step whose share of FAILED trajectories passed `max_failed_share`: none of it goes to training.
    The step's groups are on the error (`groups`), so nothing is lost; the message names the top error
    classes with an example of each."""

    def __init__(self, message: str, groups: list[Group]):
        super().__init__(message)
        self.groups = groups

    @classmethod
    def check(cls, groups: Sequence[Group | GroupDigest], bound: float) -> None:
        """Raise where more than `bound` of the groups' trajectories FAILED (the groups of a step, or their
        digests summed over shards: both say each trajectory's status and last error)."""
        trajectories = [t for g in groups for t in g.trajectories]
        failed = [t for t in trajectories if t.status is Status.FAILED]
        if not trajectories or len(failed) <= bound * len(trajectories):
            return
        last_errors = [t.last_error for t in failed if t.last_error is not None]
        classes = Counter(error_class for error_class, _ in last_errors).most_common(3)
        example = dict(reversed(last_errors))
        top = "; ".join(f"{cls_} x{n} (e.g. {example[cls_]!r})" for cls_, n in classes)
        raise cls(
            f"{len(failed)} of {len(trajectories)} trajectories of the step FAILED "
            f"({len(failed) / len(trajectories):.0%}, more than max_failed_share {bound:.0%}); "
            f"top error classes: {top or 'none recorded'}",
            [g for g in groups if isinstance(g, Group)],
        )


# A group filter: a reason to drop the group (or None to keep it), or a Verdict; sync or async.
GroupFilter = Callable[[Group], "str | None | Verdict | Awaitable[str | None | Verdict]"]
GroupRewardFn = Callable[[Group], "Sequence[Any] | Awaitable[Sequence[Any]]"]  # one reward per member


class RolloutEngine:
    def __init__(
        self,
        *,
        backend: Backend,
        encoder: ChatEncoder,
        env_factory: Callable[[EnvSample], EnvRunner] | None = None,
        source: PromptSource | Iterable[dict[str, Any]] = (),
        config: EngineConfig | None = None,
        reward_fn: Callable[[Trajectory], Any] | None = None,
        group_reward_fn: GroupRewardFn | None = None,
        group_filter: GroupFilter | None = None,
        observers: Sequence[Observer] = (),
        reader: ServerReader | None = None,
    ):
        """`reward_fn(trajectory)` scores each trajectory that ends COMPLETED or TRUNCATED, as it ends (its
        return value is the reward); `group_reward_fn(group)` instead scores a whole group once all its
        members have ended. Either may be async; a raise or a timeout is a REWARD error, retried within
        the retry policy, then the trajectory (the group's members) fails. `group_filter` sees each scored
        group and may drop it. An engine without `env_factory` and `source` runs only the trajectories others
        drive on its scheduler (a session gateway's chains: `Gateway(engine.scheduler)`). `reader`: SGLang's
        parsers read every turn on the servers (`Settings.server_reader`); checked once at start."""
        config = config or EngineConfig()
        self.recorder = next((o for o in observers if isinstance(o, MetricsRecorder)), None)
        if self.recorder is None and config.metrics_port is not None:
            self.recorder = MetricsRecorder()
            observers = (*observers, self.recorder)
        if self.recorder is not None:
            self.recorder.staleness_bound = config.max_staleness
        self.observers = tuple(observers)
        self.backend, self.encoder, self.env_factory, self.config = backend, encoder, env_factory, config
        self.source = source if isinstance(source, PromptSource) else RowSource(source)
        self.group_filter = group_filter or (_drop_zero_std if config.drop_zero_std else None)
        self.group_reward_fn = group_reward_fn
        sampling = config.sampling
        if not sampling.stop_token_ids:
            sampling = replace(sampling, stop_token_ids=encoder.stop_token_ids)
        self.scheduler = Scheduler(
            backend=backend, encoder=encoder, sampling=sampling, limits=config.limits, retry=config.retry,
            breaker=CircuitBreaker(
                threshold=config.breaker_threshold, window_s=config.breaker_window_s,
                min_attempts=config.breaker_min_attempts,
            ),
            max_generating=config.max_generating, max_env_steps=config.max_env_steps, policy=config.policy,
            max_staleness=config.max_staleness, on_stale=config.on_stale, max_restarts=config.max_restarts,
            group_left=self._group_left,
            reward_fn=None if group_reward_fn is not None else reward_fn, observers=self.observers,
            seed=config.seed, seed_base=config.sampling_seed_base, reader=reader,
        )  # fmt: skip
        self.exporter: MetricsExporter | None = None
        self.last_step_summary: dict[
            str, Any
        ] = {}  # slime's rollout/ and perf/ keys, and multi_turn/, of the last step
        self._open: dict[int, Group] = {}
        self._done: deque[Group] = deque()
        self._dropped: Counter[str] = Counter()
        self._dropped_groups: list[Group] = []  # dropped by the filter since `take_dropped` was last called
        self._settled: set[int] = set()  # members of open groups that have ended and been scored
        self._wanted = 0  # finished groups the running `rollout` call still needs
        self._step_drops = 0  # groups the running `rollout` call has dropped
        self._counts: Counter[str] = Counter()
        self._num_inflight = 0
        self._exhausted = False
        self._stopped = False  # stop_step was called: the open-ended step ends
        self._changed = Broadcast()  # a trajectory ended, or a group finished
        self._group_ids = itertools.count()  # one space for the engine's groups and `run_one`'s trajectories
        self.sizer: InFlightSizer | None = None  # in_flight auto: groups in flight sized by the servers' load
        self._unsized: str | None = None  # why in_flight auto cannot size here (the servers report no load)

    async def __aenter__(self) -> RolloutEngine:
        """Start: the collector's freeze (`gc_freeze`, once per process), the backend's weight version, the metrics
        exporter. A failure here leaves nothing running and raises as it is (the backend's error, the exporter's
        address in use)."""
        if self.config.gc_freeze:
            freeze_long_lived()
        self._stack = AsyncExitStack()
        self._tasks = await self._stack.enter_async_context(anyio.create_task_group())
        self._tasks.start_soon(self.scheduler.deadlines.watch)
        try:
            self.scheduler.resume_generation(await self.backend.weight_version())
            if self.scheduler.reader is not None:  # a server without these parsers: one error, now
                await self.scheduler.reader.check()
            if self.config.metrics_port is not None:
                from engine.metrics.prometheus import MetricsExporter

                self.exporter = MetricsExporter(
                    self,
                    self.recorder,
                    host=self.config.metrics_host,
                    port=self.config.metrics_port,
                    sd_dir=self.config.metrics_sd_dir,
                    labels=self.config.metrics_labels,
                )
                self.exporter.start()
                self._stack.callback(self.exporter.stop)
        except BaseException:
            self._tasks.cancel_scope.cancel()
            await self._stack.aclose()
            raise
        registry = self.exporter.registry if self.exporter is not None else None
        self.env_host = EnvHost(self.scheduler, self._tasks, self.config, registry)  # for envs that bind to it
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Trajectories still running or paused end ABORTED."""
        self._tasks.cancel_scope.cancel()
        return await self._stack.__aexit__(*exc_info)

    # -- steps and streams ------------------------------------------------------------------------
    async def rollout(self, target_groups: int) -> list[Group]:
        """One step's worth: `target_groups` finished groups (fewer only if the source runs dry; the
        source is asked again on the next call)."""
        started, before = time.monotonic(), self.statistics()
        await self.run_step(target_groups)
        return await self.end_step(target_groups, started=started, before=before)

    async def run_step(self, target_groups: int, *, open_ended: bool = False) -> None:
        """Admit and run a step of `target_groups`: until that many groups are done, or, `open_ended`, until
        `stop_step` (a shard's step, which the place deciding for all shards ends); either way no longer than
        the source has rows or groups are open. `end_step` then takes the step's groups."""
        self._exhausted = False  # a fed source may have rows again
        if self.scheduler.is_paused:
            await self.resume()
        fixed, refilled = self.config.step_groups(target_groups)
        tail = refilled - fixed  # more groups the step's tail may start (refill)
        sizer = self._sizer_for(target_groups)
        if sizer is not None:
            sizer.step_began()
        self._wanted = target_groups
        self._step_drops = 0
        sizing = anyio.CancelScope()  # the sizer reads the servers' load while this step runs
        if sizer is not None:
            self._tasks.start_soon(self._size_by_load, sizer, sizing)
        try:
            while not self._stopped and (open_ended or len(self._done) < target_groups):
                goal = fixed if self.sizer is None else self.sizer.goal
                self._admit(goal)
                if tail > 0:  # the step's tail: start more groups while the servers could take more
                    self._admit(goal + tail, live=self.config.max_generating)
                if not self._open and self._exhausted:
                    break
                await self._wait_for_change()
        finally:
            sizing.cancel()
            self._changed.notify()  # whoever waits on this step's progress sees it end

    def stop_step(self) -> None:
        """End an open-ended `run_step` (it returns at once)."""
        self._stopped = True
        self._changed.notify()

    async def end_step(self, take: int, *, started: float, before: EngineStatistics, check: bool = True) -> list[Group]:
        """The step's groups: `take` of those done (fewer where fewer are), oldest first; the rest stay held for
        the next step. Generation pauses where partial rollout keeps groups open; the observers and the summary
        see the step. `check`: raise StepFailedError where too many of these trajectories FAILED (a shard's part
        is checked where the step is summed, over all shards)."""
        self._wanted, self._stopped = 0, False
        groups = [self._done.popleft() for _ in range(min(take, len(self._done)))]
        self._counts["returned"] += len(groups)
        if self.sizer is not None:
            self._size_by_staleness(self.sizer, [t for group in groups for t in group.trajectories])
        if self.config.partial_rollout and self._open:
            await self.scheduler.pause_generation()
        seconds = time.monotonic() - started
        for observer in self.observers:
            observer.step_ended(groups, seconds, self.scheduler.clock)
        self.last_step_summary = step_summary(
            groups, rollout_time=seconds, clock=self.scheduler.clock, after=self.statistics(), before=before
        )
        if check:
            StepFailedError.check(groups, self.config.max_failed_share)
        return groups

    def _size_by_staleness(self, sizer: InFlightSizer, returned: list[Trajectory]) -> None:
        """The step's end to the sizer: how many of its sessions came back stale, and, of those still running, how
        many are as old as the staleness bound allows (stale at their next turn after the update) or a version
        younger (stale unless they end within the next step; read where the bound is 2 or more)."""
        bound, clock = self.config.max_staleness, self.scheduler.clock
        ages = Counter(
            clock.staleness(t) for group in self._open.values() for t in group.trajectories if not t.is_ended
        )
        sizer.step_ended(
            sum(t.stop_reason is StopReason.STALE for t in returned), len(returned),
            doomed=sum(n for age, n in ages.items() if age >= bound), at_risk=ages[bound - 1] if bound >= 2 else 0,
        )  # fmt: skip

    @property
    def num_done(self) -> int:
        """Groups finished and not yet returned."""
        return len(self._done)

    async def changed(self, timeout: float | None = None) -> None:
        """Until a trajectory ends, a group finishes or a step ends (or `timeout` seconds pass)."""
        await self._changed.wait(timeout)

    def _sizer_for(self, target: int) -> InFlightSizer | None:
        """The sizer of a step of `target` groups (in_flight auto, with partial rollout, where the servers report
        their load); the one of the step before where the target is the same."""
        ceiling = self.config.in_flight_ceiling(target)
        if not self.config.partial_rollout or self.config.in_flight != "auto" or self._unsized or ceiling <= target:
            self.sizer = None  # nothing to size: over_sampling x the target (at most the target itself)
        elif self.sizer is None or (self.sizer.floor, self.sizer.ceiling) != (target, ceiling):
            self.sizer = InFlightSizer(floor=target, ceiling=ceiling)
        return self.sizer

    async def _size_by_load(self, sizer: InFlightSizer, sizing: anyio.CancelScope) -> None:
        """While the step runs (`sizing`): the servers' load, every SIZING_INTERVAL_S, to the sizer. Servers that
        report none turn sizing off for good (over_sampling x the target then, as in_flight fixed), said once."""
        report = getattr(self.backend, "reported_loads", None)
        with sizing:
            while True:
                try:
                    loads = None if report is None else await report()
                except BackendError as exc:  # a poll that failed: the next one may not
                    log.debug("in_flight auto: the servers' load could not be read: %s", exc)
                    loads = []
                if loads is None:
                    self._unsized = (
                        "the backend reports no load" if report is None else "its servers serve no /v1/loads"
                    )
                    said = log.info if report is None else log.warning
                    said("in_flight auto: %s; over_sampling x the step's target stays in flight", self._unsized)
                    self.sizer = None
                    self._changed.notify()
                    return
                if loads and sizer.observe(loads):
                    self._changed.notify()
                await anyio.sleep(SIZING_INTERVAL_S)

    async def stream(self) -> AsyncIterator[Group]:
        """Groups as they finish, admitting prompts as room frees up, until the source runs dry."""
        goal = max(1, self.config.max_inflight // self.config.n_samples_per_prompt)
        while True:
            self._admit(goal)
            if self._done:
                self._counts["returned"] += 1
                yield self._done.popleft()
            elif self._exhausted and not self._open:
                return
            else:
                await self._wait_for_change()

    async def pause(self) -> None:
        """Stop generation for a weight update: requests in flight are aborted and keep their tokens;
        env steps go on; trajectories wait, PAUSED, until `resume`."""
        await self.scheduler.pause_generation()

    async def wait_until_parked(self) -> None:
        """While paused: until every unfinished trajectory (started ones included) waits, PAUSED."""
        while self.scheduler.is_paused and self._num_inflight > self.scheduler.num_parked:
            await self.scheduler.parked_or_ended()

    async def resume(self, weight_version: str | None = None) -> None:
        """Generate again, with `weight_version` (default: what the backend reports); paused ones first.

        With `on_stale="restart"`, finished trajectories not yet returned (members of an open group, or
        of a finished group waiting for a step) whose tokens are now more than `max_staleness` versions
        old run again, so no returned token is older than the bound."""
        if weight_version is None:
            weight_version = await self.backend.weight_version()
        self.scheduler.resume_generation(weight_version)
        if self.config.on_stale == "restart":
            self._rerun_stale()

    @property
    def weight_version(self) -> str | None:
        """The version generation runs with now (the last one resumed with, or reported by the backend)."""
        return self.scheduler.clock.current

    @property
    def abandoned_env_calls(self) -> AbandonedCalls:
        """Sync env calls that ran past their timeout and still run in their threads (a process exiting
        would wait for them)."""
        return self.scheduler.abandoned_calls

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            num_prompts_admitted=self._counts["admitted"],
            num_groups_open=len(self._open),
            num_groups_done=len(self._done),
            num_groups_returned=self._counts["returned"],
            num_groups_dropped=dict(self._dropped),
            num_trajectories_inflight=self._num_inflight,
            is_source_exhausted=self._exhausted,
            weight_version_index=self.scheduler.clock.index(self.scheduler.clock.current),
            scheduler=self.scheduler.statistics(),
        )

    def group_of(self, trajectory: Trajectory) -> Group | None:
        """The open group a trajectory belongs to (while it runs or is being scored), else None."""
        group = self._open.get(trajectory.group_id)
        return group if group is not None and trajectory in group.trajectories else None

    def take_dropped(self) -> list[Group]:
        """The groups the filter dropped since the last call (slime's all-samples hook sees them)."""
        dropped, self._dropped_groups = self._dropped_groups, []
        return dropped

    @property
    def open_groups(self) -> list[Group]:
        """Groups admitted and not finished: running, or paused between steps."""
        return list(self._open.values())

    @property
    def held_groups(self) -> list[Group]:
        """Every group admitted and not yet returned: finished ones waiting for a step, then open ones."""
        return [*self._done, *self._open.values()]

    # -- admission and groups ---------------------------------------------------------------------
    def _admit(self, goal: int, *, live: int | None = None) -> None:
        """Start groups until `goal` are open or done, within max_inflight (and, given `live`, while a group
        more keeps the trajectories not yet ended within it); none while the breaker is open."""
        n = self.config.n_samples_per_prompt
        most = max(self.config.max_inflight, n)
        if live is not None:
            most = min(live, most)
        while len(self._open) + len(self._done) < goal and not self._exhausted:
            if self.scheduler.breaker.is_open or self._num_inflight + n > most:
                return
            rows = self.source.take(1)
            if not rows:
                self._exhausted = True
                return
            self._start(rows[0])

    def _start(self, row: Any) -> None:
        group_id = next(self._group_ids)
        self._counts["admitted"] += 1
        try:
            row = check_row(row, where=f"the prompt row of group {group_id}")
        except ValueError as exc:  # a bad row fails its own group, returned like any other: nothing is lost
            self._start_failed(group_id, row, PromptError(str(exc)))
            return
        metadata = row.get("metadata") or {}
        images = list(row.get("images") or [])  # for a prompt given as rendered text
        members = [
            Trajectory(prompt=row["prompt"], prompt_images=images, group_id=group_id, index=i, metadata=dict(metadata))
            for i in range(self.config.n_samples_per_prompt)
        ]
        group = self._open[group_id] = Group(group_id, row, members)
        self._num_inflight += len(members)
        for trajectory in members:
            self._tasks.start_soon(self._run, group, trajectory)

    def _start_failed(self, group_id: int, row: Any, error: PromptError) -> None:
        """A group for a row that is not a prompt row, its members FAILED with `error`, done at once."""
        row = row if isinstance(row, dict) else {"prompt": "", "given": row}
        prompt = row.get("prompt") if isinstance(row.get("prompt"), list | str) else ""
        members = [
            Trajectory(prompt=prompt, group_id=group_id, index=i) for i in range(self.config.n_samples_per_prompt)
        ]
        for trajectory in members:
            trajectory.finish(record_failure(trajectory, error))
            for observer in self.observers:
                observer.trajectory_ended(trajectory)
        self._done.append(Group(group_id, row, members))
        self._changed.notify()

    def _rerun_stale(self) -> None:
        """Ended members not yet returned whose tokens are now too old run again, within their restarts;
        those whose restarts are spent end STALE (returned, not trained on)."""
        too_old = lambda t: t.status in SCORED and self.scheduler.clock.staleness(t) > self.config.max_staleness  # noqa: E731
        for group in [*self._done, *self._open.values()]:
            stale = [i for i, t in enumerate(group.trajectories) if too_old(t)]
            rerun = [i for i in stale if self.scheduler.may_restart(group.trajectories[i])]
            for index in set(stale) - set(rerun):
                group.trajectories[index].abort_after_end(StopReason.STALE)
                self.scheduler.count_finished_stale()
            if rerun and group in self._done:
                self._done.remove(group)  # back in flight until its stale members have run again
                self._open[group.group_id] = group
            for index in rerun:
                self._rerun(group, index)

    def _rerun(self, group: Group, index: int) -> None:
        """Replace an ended member with a fresh run of the same prompt (its tokens are discarded)."""
        old = group.trajectories[index]
        self._settled.discard(old.id)
        self.scheduler.count_discarded(old)
        fresh = Trajectory(
            prompt=old.prompt,
            prompt_images=old.prompt_images,
            group_id=old.group_id,
            index=index,
            metadata=dict(group.row.get("metadata") or {}),
        )
        fresh.metadata["num_restarts"] = old.metadata.get("num_restarts", 0) + 1
        group.trajectories[index] = fresh
        self._num_inflight += 1
        self._tasks.start_soon(self._run, group, fresh)

    async def _run(self, group: Group, trajectory: Trajectory) -> None:
        sample = EnvSample.from_row(group.row, index=trajectory.index, group_index=group.group_id)
        try:
            await self.scheduler.drive(trajectory, partial(self._build_env, sample, trajectory))
            await self._maybe_check_drift(trajectory)
        finally:
            self._num_inflight -= 1
        self._settled.add(trajectory.id)  # ended and scored
        if all(t.id in self._settled for t in group.trajectories):  # the last one scores the group, emits it
            try:
                await self._finish_group(group, trajectory)
            except Exception as exc:  # noqa: BLE001 -- a bug here must not lose the group or stop the engine
                log.error("finishing group %d failed; its members fail", group.group_id, exc_info=exc)
                self._fail_group(group, InternalError.of(exc, f"finishing group {group.group_id}"))
        self._changed.notify()

    async def _build_env(self, sample: Any, trajectory: Trajectory) -> EnvRunner:
        """The env of one trajectory; a factory that may block (a user's `build_env`, which often creates a
        remote sandbox) builds it in a worker thread. An env that binds to the engine (engine/hosting.py) gives the
        runner itself."""
        if self.env_factory is None:
            raise EnvError(ErrorClass.ENV_EXCEPTION, "the engine was given no env_factory to build this env with")
        if getattr(self.env_factory, "blocking", False):
            runner = await anyio.to_thread.run_sync(self.env_factory, sample)
        else:
            runner = self.env_factory(sample)
        if isinstance(env := getattr(runner, "env", None), HostedEnv):  # (an env worker's runner holds no env)
            runner = env.bind_runner(self.env_host, trajectory, sample, runner.name)
        return runner

    async def run_one(
        self, trajectory: Trajectory, sample: Any, sampling: SamplingParams | None = None, *, end_on_abort: bool = True
    ) -> Trajectory:
        """Run one trajectory of the caller's (slime's custom generate function: one Sample at a time) on
        this engine: its slots, retries and metrics, counted in flight, a group id of its own, ended
        ABORTED with the engine. The env is built from `sample`. A request aborted by someone else (slime
        aborts every request at the end of its step) ends it ABORTED, its tokens kept; not scored here."""
        trajectory.group_id = next(self._group_ids)
        self._num_inflight += 1
        done = anyio.Event()

        async def run() -> None:
            try:
                await self.scheduler.drive(
                    trajectory,
                    partial(self._build_env, sample, trajectory),
                    sampling,
                    score=False,
                    end_on_abort=end_on_abort,
                )
            finally:
                self._num_inflight -= 1
                done.set()
                self._changed.notify()

        self._tasks.start_soon(run)
        await done.wait()
        return trajectory

    async def _finish_group(self, group: Group, last: Trajectory) -> None:
        members = list(group.trajectories)
        if self.group_reward_fn is not None and any(t.status in SCORED for t in members):
            rewards = await self._score_group(group, last)
            if group.trajectories != members:
                return  # a member was rerun meanwhile (gone stale): its end scores the group again
            self._apply_group_rewards(members, rewards)
        if self.config.mask_offpolicy:
            for trajectory in group.trajectories:
                mask_offpolicy(trajectory, self.scheduler.clock)
        verdict = await self._verdict(group)  # the group stays open (held) until it is done or dropped
        if group.trajectories != members:
            return
        if isinstance(verdict, FilterError):  # kept, its members failed: nothing is lost, nothing trained on
            self._fail_group(group, verdict)
            return
        del self._open[group.group_id]
        self._settled.difference_update(t.id for t in members)
        if verdict.keep:
            self._done.append(group)
            return
        reason = verdict.reason or "unspecified"
        self._dropped[reason] += 1
        self._step_drops += 1
        self._dropped_groups.append(group)
        for observer in self.observers:
            observer.group_dropped(group, reason)

    async def _score_group(self, group: Group, last: Trajectory) -> list[Any] | TurnError:
        """The group's rewards, one per member, or the error that ended its retries (REWARD, or the class
        the reward function raised)."""
        budget = RetryBudget(self.config.retry)
        size = len(group.trajectories)
        try:
            rewards = list(await self.scheduler.score(self.group_reward_fn, group, budget, last))
        except TurnError as exc:
            return exc
        if len(rewards) != size:
            return RewardError(
                f"the group reward function gave {len(rewards)} rewards for group {group.group_id} of {size}"
            )
        return rewards

    @staticmethod
    def _apply_group_rewards(members: list[Trajectory], rewards: list[Any] | TurnError) -> None:
        """Rewards onto the members; a failed group reward fails every member it would have scored."""
        if isinstance(rewards, TurnError):
            for trajectory in members:
                if trajectory.status in SCORED:
                    trajectory.fail_after_end(rewards.record(trajectory.current_turn))
            return
        for trajectory, reward in zip(members, rewards, strict=True):
            trajectory.reward = reward

    def _fail_group(self, group: Group, error: TurnError) -> None:
        """The group is returned with every member that has not failed yet FAILED by `error` (still-running
        members included, when a bug struck: they end ABORTED with the engine later, unreturned)."""
        for trajectory in group.trajectories:
            if trajectory.status in SCORED:
                trajectory.fail_after_end(error.record(trajectory.current_turn))
        if self._open.pop(group.group_id, None) is not None:
            self._settled.difference_update(t.id for t in group.trajectories)
            self._done.append(group)

    async def _verdict(self, group: Group) -> Verdict | FilterError:
        """Whether to keep a finished group: the filter's answer, with slime's rule for
        `keep_when_insufficient` (kept when the step has no other candidate for its place, or has dropped its
        over-sampling margin already: slime drops such groups only from the one round of
        `--over-sampling-batch-size` it sampled; replacing each drop, as for other groups, would sample without
        end once every group earns the same); a filter that raises or answers out of shape gives a FILTER error."""
        if self.group_filter is None:
            return Verdict(keep=True)
        try:
            answer = await maybe_await(self.group_filter(group))
        except Exception as exc:  # noqa: BLE001 -- a broken filter must not lose the group or the step
            log.warning("group filter raised %r for group %d; its members fail", exc, group.group_id)
            error = FilterError(f"the group filter raised {exc!r} for group {group.group_id}")
            error.__cause__ = exc
            return error
        if not (answer is None or isinstance(answer, Verdict | str)):
            return FilterError(
                f"the group filter answered {answer!r} for group {group.group_id}: "
                "expected a Verdict, a reason (str) or None"
            )
        verdict = answer if isinstance(answer, Verdict) else Verdict(keep=answer is None, reason=answer)
        candidates = len(self._open) + len(self._done)  # groups this step can still return, this one too
        in_flight = self.sizer.goal if self.sizer is not None else self.config.step_groups(self._wanted)[0]
        margin = in_flight - self._wanted  # what slime's one round may drop
        insufficient = candidates <= self._wanted or (self._wanted and self._step_drops >= margin)
        if not verdict.keep and verdict.keep_when_insufficient and insufficient:
            return Verdict(keep=True)
        return verdict

    async def _maybe_check_drift(self, trajectory: Trajectory) -> None:
        """Every `drift_check_every`-th finished trajectory: compare it with a full re-render. A check that
        raises (a template that cannot render the whole conversation) fails that trajectory."""
        every = self.config.drift_check_every
        if (
            not every
            or not trajectory.turns
            or isinstance(trajectory.prompt, str)
            or not hasattr(self.encoder, "adrift_check")
        ):
            return
        self._counts["finished"] += 1
        if self._counts["finished"] % every:
            return
        try:
            report = await self.encoder.adrift_check(trajectory)
        except Exception as exc:  # noqa: BLE001 -- the trajectory's tokens cannot be checked: not trained on
            error = ObservationError(f"the drift check could not re-render trajectory {trajectory.id}: {exc!r}")
            if trajectory.status in SCORED:
                trajectory.fail_after_end(error.record(trajectory.current_turn))
            else:
                trajectory.errors.append(error.record(trajectory.current_turn))
            return
        for observer in self.observers:
            observer.drift_checked(trajectory, report)

    def _group_left(self, trajectory: Trajectory) -> int:
        group = self._open.get(trajectory.group_id)
        return 0 if group is None else sum(not t.is_ended for t in group.trajectories)

    async def _wait_for_change(self) -> None:
        """Until a trajectory ends (or, with the breaker open, its window has moved on)."""
        await self._changed.wait(self.config.breaker_window_s if self.scheduler.breaker.is_open else None)


def _drop_zero_std(group: Group) -> str | None:
    rewards = [r for r in group.rewards if isinstance(r, int | float)]
    return "zero_std" if len(group.trajectories) > 1 and len(set(rewards)) <= 1 else None
