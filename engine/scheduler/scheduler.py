"""The turn-level scheduler: many trajectories in flight, each holding a slot only for what it does now.

Every trajectory is driven by its own coroutine through the same turn functions as the reference
loop (`engine.turn`), but a generate call holds a generation slot and an env step an env slot, and
nothing is held in between: while one trajectory waits on a slow tool, others generate. Slots are
handed out by priority (`queue.Policy`). Failures are retried within budgets (`retry`); pausing
generation aborts the requests on the backend, which keep their tokens, and parks every trajectory
that wants to generate until generation resumes, paused ones first (`partial`).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Literal

import anyio

from engine.backends.base import STREAM_BROKEN, Backend, SamplingParams
from engine.encoding import ChatEncoder
from engine.envs.base import AbandonedCalls, EnvRunner
from engine.envs.deadlines import Deadlines
from engine.errors import (
    BackendError,
    EnvError,
    ErrorClass,
    InternalError,
    PromptError,
    ResponseError,
    RewardError,
    TurnError,
)
from engine.metrics.events import Observer
from engine.parsers import use_parser
from engine.scheduler.partial import VersionClock
from engine.scheduler.queue import Phase, Policy, PriorityLimiter, SchedulerStatistics, priority_key
from engine.scheduler.retry import CircuitBreaker, RetryBudget, RetryPolicy
from engine.scheduler.signals import Broadcast
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import (
    ServerReader,
    TurnLimits,
    close_env,
    encode_prompt,
    end_of_turn,
    generate_turn,
    observe,
    out_of_room,
    record_failure,
    step_env,
    turn_parser,
)

log = logging.getLogger(__name__)

SCORED = (Status.COMPLETED, Status.TRUNCATED)  # the ended trajectories a reward function scores

# Builds the env of one trajectory (again, for a retry on a fresh env); may be async, may raise EnvError.
EnvBuilder = Callable[[], "EnvRunner | Awaitable[EnvRunner]"]

ABORT_RETRY_S = 1.0  # while pausing: abort again if requests are still on the backend after this long


class _Env:
    """The env a trajectory is stepping now, and how to build a fresh one when a retry needs it."""

    __slots__ = ("runner", "build")

    def __init__(self, build: EnvBuilder):
        self.runner: EnvRunner | None = None
        self.build = build


class Scheduler:
    def __init__(
        self,
        *,
        backend: Backend,
        encoder: ChatEncoder,
        sampling: SamplingParams,
        limits: TurnLimits,
        retry: RetryPolicy,
        breaker: CircuitBreaker,
        max_generating: int,
        max_env_steps: int,
        policy: Policy = Policy.FIFO,
        max_staleness: int = 1,
        on_stale: Literal["restart", "finish"] = "restart",
        max_restarts: int = 2,
        end_on_abort: bool = False,
        group_left: Callable[[Trajectory], int] = lambda t: 0,
        reward_fn: Callable[[Trajectory], Any] | None = None,
        observers: Sequence[Observer] = (),
        seed: int = 0,
        seed_base: int | None = None,
        reader: ServerReader | None = None,
    ):
        """`end_on_abort`: a request aborted by someone else (not by a pause of this scheduler: slime's
        own end-of-step abort, say) ends its trajectory ABORTED; otherwise it is a SERVER error, retried. A stream
        that broke mid-way (`STREAM_BROKEN`) is a SERVER error either way: the turn goes on from its tokens."""
        self.backend, self.encoder, self.sampling, self.limits = backend, encoder, sampling, limits
        self.reader = reader  # SGLang's parsers read each turn on the servers (turn_parser); None: the engine's
        # a backend over several servers places sessions; told when one ends (BackendPool.end_session)
        self._end_session: Callable[[str], None] | None = getattr(backend, "end_session", None)
        self.retry, self.breaker = retry, breaker
        self.policy, self.max_staleness, self.on_stale = Policy(policy), max_staleness, on_stale
        self.max_restarts, self.end_on_abort = max_restarts, end_on_abort
        self.group_left, self.reward_fn, self.observers = group_left, reward_fn, tuple(observers)
        self.clock = VersionClock()
        self.generation_slots = PriorityLimiter(max_generating, name="generation slots")
        self.env_slots = PriorityLimiter(max_env_steps, name="env slots")
        self._env_threads = anyio.CapacityLimiter(max_env_steps)  # worker threads of sync envs
        self.deadlines = Deadlines()  # env step timeouts, one watcher for all (the engine runs `watch`)
        self.abandoned_calls = AbandonedCalls()  # sync env calls past their timeout, still in their threads
        self._rng = random.Random(seed)
        self.seed_base = seed_base  # per-request sampling seeds: seed_base + index in group (None: unseeded)
        self._phase: dict[int, tuple[Phase, float]] = {}  # trajectory id -> (phase, since when)
        self._phase_counts: dict[Phase, int] = dict.fromkeys(Phase, 0)  # plain ints: read from any thread
        self._resumed_at = time.monotonic()
        self._waiting_to_generate: dict[int, Trajectory] = {}
        self._generating: dict[str, Trajectory] = {}
        self._rid_prefix, self._rids = uuid.uuid4().hex[:12], itertools.count()  # request ids, unique per scheduler
        self._drained = Broadcast()  # the last request on the backend returned
        self._parked = Broadcast()  # a trajectory parked or ended
        self._counts: Counter[str] = Counter()
        self._retries: Counter[ErrorClass] = Counter()
        self._exhausted: Counter[ErrorClass] = Counter()

    # -- one trajectory ---------------------------------------------------------------------------
    def _forget_session(self, trajectory: Trajectory) -> None:
        """Tell the backend that `trajectory`'s session is over; a backend that fails at it is logged, and
        neither this trajectory nor any other is the worse for it."""
        if self._end_session is None:
            return
        try:
            self._end_session(trajectory.session_id)
        except Exception as exc:  # noqa: BLE001 -- placement bookkeeping must not end a trajectory
            log.warning("ending session %s on the backend failed", trajectory.session_id, exc_info=exc)

    async def drive(
        self,
        trajectory: Trajectory,
        build_env: EnvBuilder,
        sampling: SamplingParams | None = None,
        *,
        score: bool = True,
        end_on_abort: bool | None = None,
    ) -> None:
        """Run `trajectory` to its end with the env `build_env()` gives (and `sampling`, default the
        scheduler's), then score it with the reward function (unless `score` is False).

        It ends in exactly one terminal status, whatever goes wrong: a failure of its own work (building
        or stepping its env, encoding, generating, scoring; any exception, classified or not) ends it
        FAILED with the error recorded, and nothing else; cancellation ends it ABORTED. While generation
        is paused it waits, PAUSED, with its env and its turn state."""
        sampling = self.sampling_for(trajectory, sampling or self.sampling)
        end_on_abort = self.end_on_abort if end_on_abort is None else end_on_abort
        env = _Env(build_env)
        budget = RetryBudget(self.retry)
        try:
            stop: StopReason | None = None
            try:
                encoder = self._encoder(trajectory)  # a prompt's tools that break the template fail it here
                stop = await self._run(trajectory, env, encoder, budget, sampling, end_on_abort)
            except TurnError as exc:
                stop = record_failure(trajectory, exc)
            except Exception as exc:  # noqa: BLE001 -- whatever it is, it is this trajectory's alone
                log.error("trajectory %d failed on an unexpected error", trajectory.id, exc_info=exc)
                stop = record_failure(trajectory, InternalError.of(exc, f"handling trajectory {trajectory.id}"))
            finally:  # cancellation included: the trajectory ends ABORTED
                if env.runner is not None:
                    await close_env(env.runner, trajectory)
                trajectory.finish(stop or StopReason.ABORTED)
                self._forget_session(trajectory)
            if score and self.reward_fn is not None and trajectory.status in SCORED:
                try:
                    trajectory.reward = await self.score(self.reward_fn, trajectory, budget, trajectory)
                except TurnError as exc:  # REWARD, or a class the reward function raised (an LLM judge's)
                    trajectory.fail_after_end(exc.record(trajectory.current_turn))
        finally:
            if budget.total:
                trajectory.metadata["retries"] = {str(cls): n for cls, n in budget.by_class.items()}
            self._turn_ended(trajectory, trajectory.stop_reason)  # a turn cut short by a failure
            self._set_phase(trajectory, None)
            self._parked.notify()
            trajectory.check_invariant()
            for observer in self.observers:
                observer.trajectory_ended(trajectory)

    async def _run(
        self,
        trajectory: Trajectory,
        env: _Env,
        encoder: ChatEncoder,
        budget: RetryBudget,
        sampling: SamplingParams,
        end_on_abort: bool,
    ) -> StopReason:
        """The turn loop (the module docstring of `engine.turn` numbers its steps): the stop reason it
        ends with. Ending too stale, it runs again from the prompt (`on_stale="restart"`, within
        `max_restarts`) or ends STALE."""
        skip_special = sampling.skip_special_tokens  # the env reads the model's turn as SGLang's `text` has it
        first = await self._env_call(trajectory, budget, env, _reset, encoder=encoder, skip_special=skip_special)
        if env.runner is not None and env.runner.gives_prompt:  # the env's prompt (an agent's first request)
            encoder = self._take_prompt(trajectory, first)
        await encode_prompt(trajectory, encoder)  # 1
        trajectory.transition(Status.RUNNING)
        step = partial(
            step_env, trajectory=trajectory, encoder=encoder, skip_special_tokens=skip_special, reader=self.reader
        )
        while True:
            stop = out_of_room(trajectory, self.limits)
            while stop is None:
                stop = await self._generate(trajectory, env, budget, sampling, encoder, end_on_abort)  # 2, 3
                if stop is None:
                    await self._read(trajectory, budget, encoder)  # 3b, where the servers read turns
                    result = await self._env_call(
                        trajectory, budget, env, step, encoder=encoder, skip_special=skip_special
                    )  # 4
                    stop = end_of_turn(trajectory, result, self.limits)
                    if stop is None:
                        message = await self._format(trajectory, budget, env.runner, result.observation)
                        stop = await observe(trajectory, message, encoder, self.limits)  # 5
                self._turn_ended(trajectory, stop)
            if stop in (StopReason.ABORTED, StopReason.STALE) or self.clock.staleness(trajectory) <= self.max_staleness:
                return stop
            if not await self._stale(trajectory, env, budget):  # the bound holds when it ends, too
                return StopReason.STALE

    def sampling_for(self, trajectory: Trajectory, sampling: SamplingParams) -> SamplingParams:
        """`sampling` for this trajectory: with a seed base, seed + its index in the group (as slime seeds
        the members of a group with deterministic inference)."""
        if self.seed_base is None:
            return sampling
        return replace(sampling, sampling_seed=self.seed_base + trajectory.index)

    async def score(self, fn: Callable[[Any], Any], subject: Any, budget: RetryBudget, trajectory: Trajectory) -> Any:
        """`fn(subject)` (a trajectory or a group; sync or async) under the reward timeout, retried within
        `budget`: a raise or a timeout is a REWARD error (a TurnError raised keeps its own class, as an LLM
        judge's JUDGE does), and a spent budget raises it."""
        what = f"trajectory {trajectory.id}" if subject is trajectory else f"group {trajectory.group_id}"
        while True:
            self._set_phase(trajectory, Phase.SCORING)
            try:
                value = fn(subject)
                if not isinstance(value, Awaitable):  # a synchronous rule: done, and no timeout could stop it
                    return value
                with anyio.fail_after(self.retry.reward_timeout_s):
                    return await value
            except TimeoutError as exc:
                error = RewardError(f"no reward for {what} within {self.retry.reward_timeout_s:g} s")
                error.__cause__ = exc
            except TurnError as exc:  # classified already (an LLM judge's JUDGE): its class and budget hold
                error = exc
            except Exception as exc:  # noqa: BLE001 -- any failure of the reward function is this subject's
                error = RewardError(f"the reward function raised {exc!r} for {what}")
                error.__cause__ = exc
            finally:
                self._set_phase(trajectory, None)
            attempt = self._charge(trajectory, budget, error)
            await anyio.sleep(self.retry.backoff(attempt, self._rng))

    def _turn_ended(self, trajectory: Trajectory, stop: StopReason | None) -> None:
        """Tell the observers about the last turn, once: "continued", or the stop reason it ended with."""
        if not self.observers or not trajectory.turns or trajectory.turns[-1].is_reported:
            return
        turn = trajectory.turns[-1]
        turn.is_reported = True
        for observer in self.observers:
            observer.turn_ended(trajectory, turn, "continued" if stop is None else str(stop))

    def _set_phase(self, trajectory: Trajectory, phase: Phase | None) -> None:
        old = self._phase.pop(trajectory.id, None) if phase is None else self._phase.get(trajectory.id)
        if old is not None:
            self._phase_counts[old[0]] -= 1
        if phase is not None:
            self._phase[trajectory.id] = (phase, time.monotonic())
            self._phase_counts[phase] += 1

    async def _generate(
        self,
        trajectory: Trajectory,
        env: _Env,
        budget: RetryBudget,
        sampling: SamplingParams,
        encoder: ChatEncoder,
        end_on_abort: bool,
    ) -> StopReason | None:
        """Steps 2 and 3: generate until the turn's generation is complete (a turn aborted by a pause is
        continued once generation resumes); then whether that ends the trajectory."""
        while True:
            waited = await self._acquire_generation(trajectory)
            if self.clock.staleness(trajectory) > self.max_staleness:
                self.generation_slots.release()
                if not await self._stale(trajectory, env, budget):
                    return StopReason.STALE
                continue
            rid = f"{self._rid_prefix}-{next(self._rids)}"
            self._generating[rid] = trajectory
            self._set_phase(trajectory, Phase.GENERATING)
            try:
                result = await generate_turn(
                    trajectory, self.backend, sampling, self.limits, rid=rid, encoder=encoder,
                    on_listener_error=self._listener_failed,
                )  # fmt: skip
                turn = trajectory.turns[-1]
                turn.queue_seconds += waited
                stop = out_of_room(trajectory, self.limits)
                goes_on = turn.finish_reason == "abort" and stop is None  # cut short, with room left
                if goes_on and STREAM_BROKEN in result.meta:  # the tokens that came are kept; the turn goes on
                    raise BackendError(ErrorClass.SERVER, f"the stream broke: {result.meta[STREAM_BROKEN]}")
                foreign_abort = goes_on and not self.generation_slots.is_closed
                if foreign_abort and not end_on_abort:
                    raise BackendError(
                        ErrorClass.SERVER, "the backend aborted the request while generation was not paused"
                    )
            except ResponseError:  # the server answered; the model's turn is what cannot go on
                self.breaker.record(True)
                trajectory.turns[-1].queue_seconds += waited
                raise
            except BackendError as exc:
                self.breaker.record(False)
                attempt = self._charge(trajectory, budget, exc)
            else:
                self.breaker.record(True)
                self.clock.observe(result.weight_version)
                if goes_on:
                    if foreign_abort:
                        return StopReason.ABORTED  # aborted by its caller: it ends here, tokens kept
                    continue  # paused mid-turn, with room left: the turn goes on once generation resumes
                turn.cut_at_cap = turn.finish_reason == "length" and stop is None
                return stop
            finally:
                del self._generating[rid]
                self.generation_slots.release()
                if not self._generating:
                    self._drained.notify()
            await anyio.sleep(self.retry.backoff(attempt, self._rng))

    async def _env_call(
        self,
        trajectory: Trajectory,
        budget: RetryBudget,
        env: _Env,
        fn: Callable[[EnvRunner], Awaitable[Any]],
        *,
        encoder: ChatEncoder,
        skip_special: bool,
    ) -> Any:
        """`fn(runner)`, an env operation, under an env slot (unless the env `needs_env_slot` not: it only
        waits on work done elsewhere); the env is built first if it is not yet.

        A failure is retried, within the budget, only where that cannot repeat an action or race one
        still running: an env that raised `EnvRetryableError` is called again as it is; a `replay_safe`
        env is reset and stepped through the earlier responses first (a fresh env when a call that timed
        out still runs in its thread). Any other env's failure ends the trajectory."""
        recover: Literal["again", "replay", "build"] | None = "build" if env.runner is None else None
        while True:
            self._set_phase(trajectory, Phase.WAITING_FOR_ENV)
            started = time.monotonic()
            slotted = env.runner is None or env.runner.needs_env_slot  # an env that only waits holds none
            if slotted:
                await self.env_slots.acquire(self._key, trajectory)
            waited = time.monotonic() - started
            self._set_phase(trajectory, Phase.IN_ENV)
            try:
                if recover == "build":
                    await self._build_env(trajectory, env, replay=fn is not _reset, encoder=encoder, skip=skip_special)
                elif recover == "replay":
                    await self._replay(trajectory, env.runner, encoder, skip_special)
                recover = None
                result = await fn(env.runner)
            except EnvError as exc:
                self.breaker.record(False)
                recover = _recovery(env.runner, exc, is_reset=fn is _reset)
                if recover is None:
                    raise exc.noted(f"not retried: env {env.runner.name} is not replay_safe") from exc
                attempt = self._charge(trajectory, budget, exc)
            else:
                self.breaker.record(True)
                if trajectory.turns:
                    trajectory.turns[-1].env_queue_seconds += waited
                return result
            finally:
                if slotted:
                    self.env_slots.release()
            await anyio.sleep(self.retry.backoff(attempt, self._rng))

    async def _build_env(
        self, trajectory: Trajectory, env: _Env, *, replay: bool, encoder: ChatEncoder, skip: bool
    ) -> None:
        """A fresh env for the trajectory (the one before is closed first; a call of it still running is
        waited for, bounded by the close timeout) and, when `replay` (a step is to be retried), reset and
        stepped through the earlier responses. A factory that raises is an ENV_EXCEPTION."""
        old, env.runner = env.runner, None
        if old is not None:
            await close_env(old, trajectory)
        try:
            runner = env.build()
            if isinstance(runner, Awaitable):
                runner = await runner
        except EnvError:
            raise
        except Exception as exc:
            raise EnvError(ErrorClass.ENV_EXCEPTION, f"building the env raised {exc!r}") from exc
        runner.limiter, runner.deadlines = self._env_threads, self.deadlines
        runner.abandoned_calls = self.abandoned_calls
        if runner.step_timeout is None:
            runner.step_timeout = self.retry.env_step_timeout_s
        env.runner = runner
        if replay:
            await self._replay(trajectory, runner, encoder, skip)

    async def _replay(
        self, trajectory: Trajectory, runner: EnvRunner, encoder: ChatEncoder, skip_special: bool
    ) -> None:
        """Reset the env and step it through every earlier turn's response, each read as it was the first time,
        so its state is rebuilt."""
        await runner.reset()
        for turn in trajectory.turns[:-1]:
            text = encoder.response_text(trajectory.generated_ids(turn).tolist(), skip_special_tokens=skip_special)
            with use_parser(turn_parser(turn, text, encoder, self.reader), in_reasoning=encoder.opens_reasoning):
                await runner.step(text)

    async def _read(self, trajectory: Trajectory, budget: RetryBudget, encoder: ChatEncoder) -> None:
        """Step 3b: the servers' parsers read the turn just generated (`Turn.reading`), where they read turns; a
        backend error is retried within its class's budget, as a generation's is."""
        turn = trajectory.turns[-1]
        if self.reader is None or turn.reading is not None:
            return
        generated = trajectory.generated_ids(turn).tolist()
        while True:
            try:
                turn.reading = await self.reader.read(generated, encoder)
                return
            except BackendError as exc:
                if not exc.retryable:
                    raise exc.noted(f"reading the turn with SGLang's {self.reader.name} parser") from exc
                attempt = self._charge(trajectory, budget, exc)
            await anyio.sleep(self.retry.backoff(attempt, self._rng))

    async def _format(
        self, trajectory: Trajectory, budget: RetryBudget, runner: EnvRunner, observation: dict[str, Any]
    ) -> dict[str, Any]:
        """The env's observation as a chat message; a failed `format_observation` is retried (within the
        budget) by formatting again, never by stepping the env again."""
        while True:
            try:
                return runner.message(observation)
            except EnvError as exc:
                attempt = self._charge(trajectory, budget, exc)
            await anyio.sleep(self.retry.backoff(attempt, self._rng))

    def _take_prompt(self, trajectory: Trajectory, observation: dict[str, Any]) -> ChatEncoder:
        """The prompt an env gave on reset (`gives_prompt`): the trajectory's, with its tools; the encoder for it."""
        prompt = observation.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
            raise EnvError(ErrorClass.ENV_EXCEPTION, f"an env that gives the prompt reset to {str(prompt)[:200]!r}")
        trajectory.prompt = prompt
        if observation.get("tools"):
            trajectory.metadata["tools"] = observation["tools"]
        return self._encoder(trajectory)

    def _encoder(self, trajectory: Trajectory) -> ChatEncoder:
        """The encoder for this trajectory: with the tools its prompt row names (slime's `metadata["tools"]`)
        rendered into every observation. Tools the chat template cannot render are a BAD_PROMPT."""
        tools = trajectory.metadata.get("tools")
        try:
            return self.encoder.for_tools(tools)
        except Exception as exc:  # noqa: BLE001 -- a template's raise_exception, a schema it recurses into
            raise PromptError(f"the chat template does not render the prompt's tools: {exc!r}") from exc

    async def _stale(self, trajectory: Trajectory, env: _Env, budget: RetryBudget) -> bool:
        """Too stale to go on or to return: start again from the prompt (tokens discarded, env reset), and
        True; or, with `on_stale="finish"`, its restarts spent or an env that is not `restartable` (an agent
        session: the agent saw the turns), False (it ends STALE)."""
        if not self.may_restart(trajectory) or (env.runner is not None and not env.runner.restartable):
            self.count_finished_stale()
            return False
        self.count_discarded(trajectory)
        trajectory.restart()
        encoder = self._encoder(trajectory)
        await encode_prompt(trajectory, encoder)
        await self._env_call(trajectory, budget, env, _reset, encoder=encoder, skip_special=True)
        return True

    def may_restart(self, trajectory: Trajectory) -> bool:
        """Whether a trajectory gone too stale may run again (else it ends STALE, not trained on)."""
        return self.on_stale == "restart" and trajectory.metadata.get("num_restarts", 0) < self.max_restarts

    def count_discarded(self, trajectory: Trajectory) -> None:
        """A trajectory thrown away whole to run again (gone too stale)."""
        self._counts["restarted"] += 1
        self._counts["discarded_tokens"] += trajectory.num_generated

    def count_finished_stale(self) -> None:
        self._counts["finished_stale"] += 1

    def _listener_failed(self, error: Exception) -> None:
        """A trajectory's token listener raised (generate_turn logged it and cleared it)."""
        self._counts["listener_failures"] += 1

    def _charge(self, trajectory: Trajectory, budget: RetryBudget, error: TurnError) -> int:
        """Spend a retry on `error`, or raise it (noting the spent budget) when none is left."""
        attempt = budget.charge(error, len(trajectory.turns))
        if attempt is None:
            self._exhausted[error.error_class] += 1
            raise error.noted(f"retry budget spent after {budget.total} retries") from error
        self._retries[error.error_class] += 1
        if trajectory.turns and not trajectory.is_ended:  # a retry of the turn in progress (not of a reward)
            trajectory.turns[-1].retries += 1
        log.info("retrying trajectory %d after %s: %s", trajectory.id, error.error_class, error.message)
        return attempt

    # -- generation slots, pause and resume -------------------------------------------------------
    def _key(self, trajectory: Trajectory) -> tuple[int, ...]:
        return priority_key(self.policy, trajectory, self.group_left)

    async def _acquire_generation(self, trajectory: Trajectory) -> float:
        """A generation slot, waiting PAUSED while generation is paused; returns the seconds queued for
        it, not counting a pause. A slot granted just before a pause, to a trajectory that had not run
        yet, is handed back: nothing generates while paused."""
        self._waiting_to_generate[trajectory.id] = trajectory
        self._set_phase(trajectory, Phase.WAITING_TO_GENERATE)
        started = time.monotonic()
        try:
            while True:
                if self.generation_slots.is_closed:
                    self._park(trajectory)
                await self.generation_slots.acquire(self._key, trajectory)
                if not self.generation_slots.is_closed:
                    break
                self.generation_slots.release()
        finally:
            del self._waiting_to_generate[trajectory.id]
        if trajectory.status is Status.PAUSED:
            trajectory.transition(Status.RUNNING)
            self._counts["resumed"] += 1
            started = max(started, self._resumed_at)
        return time.monotonic() - started

    def _park(self, trajectory: Trajectory) -> None:
        if trajectory.status is Status.RUNNING:
            trajectory.transition(Status.PAUSED)
            self._set_phase(trajectory, Phase.PAUSED)
            self._counts["paused"] += 1
            self._parked.notify()

    def _longest_in_phase(self) -> dict[Phase, float]:
        """Per phase, the longest any in-flight trajectory has been in it (a hung call shows here)."""
        now, longest = time.monotonic(), {}
        for phase, since in list(self._phase.values()):  # a copy: read from the exporter's thread too
            longest[phase] = max(longest.get(phase, 0.0), now - since)
        return longest

    @property
    def num_parked(self) -> int:
        return self._phase_counts[Phase.PAUSED]

    async def parked_or_ended(self) -> None:
        """Until the next trajectory parks or ends."""
        await self._parked.wait()

    async def pause_generation(self) -> None:
        """Generation stops at a safe point: requests on the backend are aborted and keep the tokens
        they produced; env steps go on; every trajectory that wants to generate waits, PAUSED. Returns
        once no request is on the backend, or as soon as generation is resumed meanwhile."""
        self.generation_slots.close()
        for trajectory in list(self._waiting_to_generate.values()):
            self._park(trajectory)
        while self._generating and self.generation_slots.is_closed:
            try:
                await self.backend.abort()
            except BackendError as exc:  # the requests fail on their own; keep waiting for them
                log.warning("abort while pausing failed: %s", exc.message)
            if self._generating:
                await self._drained.wait(ABORT_RETRY_S)

    def resume_generation(self, weight_version: str | None) -> None:
        """Generation goes on with `weight_version`; paused trajectories first."""
        self.clock.advance(weight_version)
        self._resumed_at = time.monotonic()
        self.generation_slots.open()
        self._drained.notify()  # a pause still waiting for requests gives up

    @property
    def is_paused(self) -> bool:
        return self.generation_slots.is_closed

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            phases={phase: n for phase, n in self._phase_counts.copy().items() if n},
            longest_in_phase=self._longest_in_phase(),
            generation=self.generation_slots.statistics(),
            env=self.env_slots.statistics(),
            breaker=self.breaker.statistics(),
            retries=dict(self._retries),
            budgets_exhausted=dict(self._exhausted),
            num_paused=self._counts["paused"],
            num_resumed=self._counts["resumed"],
            num_restarted=self._counts["restarted"],
            num_finished_stale=self._counts["finished_stale"],
            num_discarded_tokens=self._counts["discarded_tokens"],
            num_listener_failures=self._counts["listener_failures"],
        )


async def _reset(runner: EnvRunner) -> dict[str, Any]:
    return await runner.reset()


def _recovery(
    runner: EnvRunner | None, error: EnvError, *, is_reset: bool
) -> Literal["again", "replay", "build"] | None:
    """How an env operation that failed with `error` may be tried again, if at all: `again` as it is (the
    env asked for it, or a reset, which starts over anyway), after a `replay` of the earlier turns on the
    same env (a replay-safe env), on a fresh env `build` (nothing built yet, or a call that timed out
    still running in its thread), or not (None)."""
    if runner is None:
        return "build"
    if runner.is_busy:
        return "build" if runner.replay_safe or is_reset else None
    if is_reset or error.error_class is ErrorClass.ENV_RETRYABLE:
        return "again"
    return "replay" if runner.replay_safe else None


async def maybe_await(value: Any) -> Any:
    """`value`, awaited if it is awaitable (a sync or an async callback's result)."""
    return await value if isinstance(value, Awaitable) else value
