"""The rollout service: a RolloutEngine kept alive across slime's rollout steps.

Paused trajectories are coroutines with live envs, so the engine runs in a thread with its own event
loop (an anyio blocking portal) and outlives each `generate_rollout` call. The service is a plain
object with blocking methods: slime's rollout process holds one directly, or it lives in a named
Ray actor (`ray_actor` in the `turnstile:` settings; created on first use, attached to after) that
`turnstile serve` can also start.

    service = RolloutService(settings)
    out = service.rollout(rollout_id=3, target=32, groups=data_source.get_samples(48))
    out.samples        # list[list[Sample]], each group whole; out.metrics: the step summary
    service.resume("step-4")                      # after a weight update
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, closing, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.abc
from anyio.from_thread import start_blocking_portal

from bridge.convert import settle
from bridge.rewards import SlimeScoring, sample_of_row
from bridge.settings import BridgeSettings
from engine.backends.base import Backend, SamplingParams
from engine.config import EngineConfig
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine, StepFailedError
from engine.envs.loader import EnvFactory
from engine.envs.ray_workers import hosted
from engine.metrics.recorder import MetricsRecorder
from engine.metrics.summary import GroupDigest, step_counts, step_summary
from engine.scheduler.partial import VersionClock
from engine.source import QueueSource
from engine.statistics import EngineStatistics
from engine.trajectory import Group, Trajectory

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    samples: list[list[Any]]  # slime Samples, one list per group
    metrics: dict[str, Any]
    num_held: int  # groups admitted or queued and not yet returned
    dropped: list[list[Any]] = field(default_factory=list)  # groups the dynamic filter dropped this call
    part: StepPart | None = None  # a shard's: what the step's summary over all shards reads of this call


@dataclass(frozen=True)
class StepPart:
    """What a shard's part of a step gives the place that sums the step (bridge/shards.py): its groups' digests,
    its counts (`step_counts`) and its weight versions."""

    groups: list[GroupDigest]
    counts: dict[str, Any]
    clock: VersionClock


@dataclass(frozen=True)
class Progress:
    """A step's progress on one service: groups done and not yet returned, and whether it still runs (a step runs
    until the service is told to finish it, or its prompts run out with nothing open)."""

    done: int
    running: bool


@dataclass
class _Step:
    """The rollout step being served: its groups so far, and the engine as it was when it began."""

    rollout_id: int
    started: float
    before: EngineStatistics
    groups: list[Group] = field(default_factory=list)
    ran: anyio.Event | None = None  # the end of the engine's run of the current call (None: none started)
    error: BaseException | None = None  # what that run raised

    @property
    def running(self) -> bool:
        return self.ran is not None and not self.ran.is_set()


@dataclass(frozen=True)
class EvalDataset:
    """One eval dataset as the service runs it: prompt rows (one group of slime Samples each), and the
    sampling and budget of its own (slime's per-dataset eval settings)."""

    rows: list[dict[str, Any]]
    n_samples: int
    sampling: SamplingParams
    max_tokens: int
    reward_key: str | None = None
    max_context_len: int | None = None  # slime's eval_max_context_len (default: the rollout's window)


WEIGHT_DIRECTORY = re.compile(r"weight_v(\d+)")  # slime's RayTrainGroup: update_weight_disk_dir / weight_v{n:06d}


def weight_directories(weights_dir: Path) -> list[tuple[int, Path]]:
    """(version, directory) of each `weight_vNNNNNN` directory in `weights_dir`."""
    if not weights_dir.is_dir():
        return []
    return [(int(m[1]), p) for p in weights_dir.iterdir() if p.is_dir() and (m := WEIGHT_DIRECTORY.fullmatch(p.name))]


def _mtime(path: Path) -> float | None:
    """The modification time, or None for a directory removed meanwhile (the trainer may prune old versions)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


PINNING_POLICIES = ("consistent_hashing", "manual")  # sglang-router's policies that route by X-SMG-Routing-Key
SHARED_LOAD_POLL_S = 1.0  # rollout shards: how often each shard's pool reads the workers' GET /v1/loads


@asynccontextmanager
async def routed_backend(
    url: str,
    *,
    router_policy: str | None,
    routing: str = "auto",
    image_token_id: int | None = None,
    load_poll_s: float | None = None,
) -> AsyncIterator[Backend]:
    """The backend for slime's `--sglang-router-ip/port`: the router itself, or a pool of the workers it lists
    (several servers given comma-separated are such a pool too).

    Turnstile sends each trajectory's key as X-SMG-Routing-Key, but sglang-router pins a key to one worker only
    under consistent_hashing or manual; under its default, cache_aware, a trajectory's turns drift between
    workers as their prefixes' matches change (and lose the prefix cache of the worker they left). With
    `routing` "auto", generation then goes to the workers the router lists at start, in a BackendPool whose
    affinity placement keeps a trajectory on its worker (engine/backends/pool.py); control calls go to each
    worker as they do behind the router. Workers the router gains later are not used until the next start. With
    `load_poll_s` (rollout shards sharing the workers), the pool reads each worker's load that often and places by
    it, other shards' requests included."""
    from engine.backends.sglang import SGLangBackend

    named = [u.strip() for u in url.split(",") if u.strip()]
    if len(named) > 1:
        async with _worker_pool(named, image_token_id, load_poll_s) as pool:
            yield pool
        return
    async with SGLangBackend(url, image_token_id=image_token_id) as router:
        policy = router_policy or "cache_aware"  # sglang-router's own default, as slime starts it
        pins = policy in PINNING_POLICIES
        if not router.is_router or routing == "router" or (routing == "auto" and pins):
            yield router
            return
        urls = await router.worker_urls()
        why = f"its policy, {policy}, does not keep a trajectory on one worker" if not pins else "session_routing"
        log.warning(
            "generation goes to the %d workers of sglang-router at %s directly, each trajectory kept on one (%s)",
            len(urls), url, why,
        )  # fmt: skip
        async with _worker_pool(urls, image_token_id, load_poll_s) as pool:
            yield pool


def _worker_pool(
    urls: list[str], image_token_id: int | None, load_poll_s: float | None
) -> AbstractAsyncContextManager[Backend]:
    """SGLang servers in a BackendPool that keeps each trajectory on one (affinity)."""
    from engine.backends.pool import BackendPool
    from engine.backends.sglang import SGLangBackend

    workers = [SGLangBackend(u, image_token_id=image_token_id) for u in urls]
    return BackendPool(workers, policy="affinity", load_poll_s=load_poll_s)


class RolloutService:
    def __init__(self, settings: BridgeSettings, env_args: Any = None, *, backend: Backend | None = None):
        """`env_args` is what envs' `build_env(sample, args)` receives (slime's args; default: one with
        `max_turns`). `backend` replaces the one the settings name (the caller keeps it open)."""
        self.settings = settings
        self._given_backend = backend
        self._args = env_args  # slime's args: what its hooks and reward functions are called with
        self._env_args = env_args if env_args is not None else SimpleNamespace(max_turns=settings.max_turns)
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._source = QueueSource()
        self._step: _Step | None = None
        self._weights_loaded: tuple[Path, float] | None = None  # the last weight directory loaded, and its mtime
        self.recorder = MetricsRecorder()
        try:
            self._served, _ = self._portal.start_task(self._serve)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    async def _serve(self, *, task_status: anyio.abc.TaskStatus) -> None:
        """The engine's lifetime: contexts are entered and left in this one task (anyio's rule)."""
        from engine.models import load_tokenizer

        s = self.settings
        self._stop = anyio.Event()
        self.processor = _processor(s.tokenizer, vision=s.vision)
        self.tokenizer = self.processor.tokenizer if self.processor is not None else load_tokenizer(s.tokenizer)
        self.encoder = ChatEncoder.for_settings(self.tokenizer, s, processor=self.processor)
        self.scoring = SlimeScoring(self._args, self.tokenizer)
        async with self._backend() if self._given_backend is None else nullcontext(self._given_backend) as backend:
            self.backend = backend
            envs = EnvFactory(s.env_path, args=self._env_args, step_timeout=s.retry.env_step_timeout_s)
            self.encoder.check_env(
                s.env_path, envs.observation_roles, skip_special_tokens=s.skip_special_tokens,
                read_by_server=s.calls_read_by_server,
            )  # fmt: skip
            hosting = hosted(envs, env_workers=s.env_workers, capacity=s.env_worker_capacity, ray_address=s.ray_address)
            with closing(hosting) as self.env_factory:  # env workers, when the envs run in them, end with the engine
                self.engine = self._engine(s.engine_config(self.encoder.stop_token_ids), self.scoring, self._source)
                async with self.engine, anyio.create_task_group() as self._tasks:
                    task_status.started()
                    await self._stop.wait()
                    self._tasks.cancel_scope.cancel()

    def _engine(self, config: EngineConfig, scoring: SlimeScoring, source: Any) -> RolloutEngine:
        """An engine on this service's backend and envs, scored and filtered by slime's rules."""
        engine: RolloutEngine

        def reward(trajectory: Trajectory) -> Any:
            group = engine.group_of(trajectory)
            return scoring.reward(trajectory, sample_of_row(group, trajectory) if group is not None else None)

        engine = RolloutEngine(
            backend=self.backend, encoder=self.encoder, env_factory=self.env_factory, source=source, config=config,
            reward_fn=reward, group_reward_fn=scoring.group_reward if scoring.group else None,
            group_filter=scoring.verdict if scoring.has_filter else None, observers=[self.recorder],
            reader=self.settings.server_reader(self.backend, self.encoder.tokenizer),
        )  # fmt: skip
        return engine

    def _backend(self) -> AbstractAsyncContextManager[Backend]:
        s = self.settings
        if s.url is not None:
            return routed_backend(
                s.url,
                router_policy=s.router_policy,
                routing=s.session_routing,
                image_token_id=self.encoder.image_token_id,
                load_poll_s=SHARED_LOAD_POLL_S if s.shards > 1 else None,
            )
        from engine.backends.local import LocalBackend
        from engine.models import load_model

        refused = replace(s.sampling, sampling_seed=s.sampling_seed_base).unsupported_locally()
        if refused:
            raise ValueError(
                f"{', '.join(refused)} need SGLang servers (--sglang-router-ip/--sglang-router-port): "
                "the embedded local model cannot honour them"
            )

        model = s.model if not s.vision else "tiny-qwen2.5-vl"
        return LocalBackend(load_model(model), self.tokenizer, processor=self.processor)

    # -- steps -----------------------------------------------------------------------------------
    def num_held(self) -> int:
        """Groups admitted or queued and not yet returned: what the next step starts with."""
        return self._portal.call(self._num_held)

    async def _num_held(self) -> int:
        return len(self.engine.held_groups) + len(self._source)

    def held_prompts(self) -> list[int | None]:
        """slime's `group_index` of every group held (admitted or queued, not yet returned): which
        prompts the next steps will return."""
        return self._portal.call(self._held_prompts)

    async def _held_prompts(self) -> list[int | None]:
        rows = [group.row for group in self.engine.held_groups] + self._source.pending()
        indices = [row["samples"][0].group_index for row in rows if row.get("samples")]
        return sorted(indices, key=lambda i: (i is None, i))

    def wanted(self, target: int) -> int:
        """How many new groups a step of `target` should be given: enough to keep
        `target * over_sampling` in flight with partial rollout, and `target * refill` more for its tail to
        start; `target` otherwise."""
        return max(0, self.settings.step_groups(target)[1] - self.num_held())

    def queue(self, groups: list[tuple[int, list[Any]]]) -> None:
        """Queue groups (each with the step that first took it) for the next steps, without running one: a
        new actor taking over a dead one's."""
        self._portal.call(self._queue, groups)

    async def _queue(self, groups: list[tuple[int, list[Any]]]) -> None:
        self._source.put(row_from_group(group, rollout_id) for rollout_id, group in groups)

    def rollout(self, rollout_id: int, target: int, groups: list[list[Any]]) -> StepOutput:
        """Queue `groups` (slime Samples from the data source) and return `target` finished groups, as
        slime Samples; fewer when the queued prompts run out (give more and call again)."""
        return self._portal.call(self._rollout, rollout_id, target, groups)

    async def _rollout(self, rollout_id: int, target: int, groups: list[list[Any]]) -> StepOutput:
        """One call of a step; a step may take several (dropped groups are replaced by new prompts), and
        its metrics cover every call of the same `rollout_id` so far."""
        ran = await self._begin(rollout_id, target, groups, open_ended=False)
        await ran.wait()
        return await self._finish(target, part=False)

    # A shard's step (bridge/shards.py): begun, watched, and finished by the place that decides for all shards.
    def begin(self, rollout_id: int, target: int, groups: list[list[Any]]) -> None:
        """Queue `groups` and run a step whose in-flight work is sized for `target` groups, until `finish`."""
        self._portal.call(self._begin, rollout_id, target, groups, True)

    def progress(self, seen: int, timeout_s: float) -> Progress:
        """The step's progress, once more than `seen` groups are done, the step has stopped running, or
        `timeout_s` has passed."""
        return self._portal.call(self._progress, seen, timeout_s)

    def finish(self, take: int) -> StepOutput:
        """End the step begun: `take` of its groups done (oldest first), as slime Samples, with its part of the
        step's summary; the other groups stay held for the next step."""
        return self._portal.call(self._finish, take, True)

    async def _begin(self, rollout_id: int, target: int, groups: list[list[Any]], open_ended: bool) -> anyio.Event:
        """Queue `groups` and start the engine's run of the step (one found running goes on); the run's end."""
        if self._step is None or self._step.rollout_id != rollout_id:
            self._step = _Step(rollout_id, time.monotonic(), self.engine.statistics())
        step = self._step
        await self._queue([(rollout_id, group) for group in groups])
        if step.ran is not None and step.running:  # begun already (by a restart, before this call)
            return step.ran
        ran = step.ran = anyio.Event()
        step.error = None
        self.scoring.rollout_id = rollout_id
        if self.settings.weights_dir is not None:
            await self._load_new_weights(Path(self.settings.weights_dir))
        self._tasks.start_soon(self._run_step, step, ran, target, open_ended)
        return ran

    async def _run_step(self, step: _Step, ran: anyio.Event, target: int, open_ended: bool) -> None:
        try:
            await self.engine.run_step(target, open_ended=open_ended)
        except Exception as exc:  # noqa: BLE001 -- raised where the step is finished, to its caller
            step.error = exc
        finally:
            ran.set()

    async def _progress(self, seen: int, timeout_s: float) -> Progress:
        step = self._step
        with anyio.move_on_after(timeout_s):
            while step is not None and step.running and self.engine.num_done <= seen:
                await self.engine.changed()
        return Progress(self.engine.num_done, step is not None and step.running)

    async def _finish(self, take: int, part: bool) -> StepOutput:
        step = self._step
        if step is None or step.ran is None:
            raise RuntimeError("no step was begun on this service")
        self.engine.stop_step()
        await step.ran.wait()
        if step.error is not None:
            raise step.error
        try:
            finished = await self.engine.end_step(take, started=step.started, before=step.before, check=not part)
        except StepFailedError as exc:  # nothing of it goes to training; the message says why
            raise StepFailedError(str(exc), []) from None
        samples = [await self.scoring.samples_of(g) for g in finished]
        dropped = [await self.scoring.samples_of(g) for g in self.engine.take_dropped()]
        held = await self._num_held()
        if part:  # a shard's: the step is summed over shards, each call's on its own
            counts = step_counts(self.engine.statistics(), step.before)
            self._step = None
            digests = [GroupDigest.of(g) for g in finished]
            return StepOutput(samples, {}, held, dropped, StepPart(digests, counts, self.engine.scheduler.clock))
        step.groups += finished
        metrics = step_summary(
            step.groups, rollout_time=time.monotonic() - step.started, clock=self.engine.scheduler.clock,
            after=self.engine.statistics(), before=step.before, num_gpus=self.settings.num_gpus,
        )  # fmt: skip
        return StepOutput(samples, metrics, held, dropped)

    def agenerate(self, sample: Any, sampling_params: dict[str, Any]) -> Awaitable[Any]:
        """One trajectory for one slime Sample (slime's custom generate function), awaitable in the
        caller's asyncio loop; it runs on this service's engine, its slots and retries."""
        return asyncio.wrap_future(self._portal.start_task_soon(self._generate_one, sample, sampling_params))

    def generate_one(self, sample: Any, sampling_params: dict[str, Any]) -> Any:
        """`agenerate`, blocking (for a Ray actor's threads)."""
        return self._portal.call(self._generate_one, sample, sampling_params)

    async def _generate_one(self, sample: Any, sampling_params: dict[str, Any]) -> Any:
        """slime's own loop applies its hooks and scores the Sample after this returns (reward None
        unless the env gave one), so neither happens here. It runs in the engine's accounting; slime's
        abort at the end of its step ends it ABORTED."""
        row = row_from_group([sample], (sample.metadata or {}).get("start_rollout_id", -1))
        trajectory = Trajectory(
            prompt=row["prompt"], prompt_images=row["images"], index=sample.index or 0, metadata=dict(row["metadata"])
        )
        # the env sees slime's Sample, as in slime's own loop
        await self.engine.run_one(trajectory, sample, self._sampling(sampling_params))
        return settle(await self.scoring.convert(trajectory, into=sample), trajectory, fill_reward=False)

    def _sampling(self, params: dict[str, Any]) -> SamplingParams:
        """slime's sampling params over the engine's: temperature, top-p/k and stop ids; the per-turn cap
        stays the engine's (slime's max_new_tokens is the whole response's budget)."""
        base = self.engine.scheduler.sampling
        stop_ids = tuple(dict.fromkeys((*base.stop_token_ids, *(params.get("stop_token_ids") or ()))))
        return replace(
            base,
            temperature=params.get("temperature", base.temperature),
            top_p=params.get("top_p", base.top_p),
            top_k=params.get("top_k", base.top_k),
            stop_token_ids=stop_ids,
            max_new_tokens=min(base.max_new_tokens, params.get("max_new_tokens") or base.max_new_tokens),
        )

    def evaluate(self, datasets: dict[str, EvalDataset]) -> dict[str, dict[str, list]]:
        """Run each eval dataset to the end on an engine of its own (its sampling, budget and samples per
        prompt), scored by slime's rules; slime's eval structure: {name: {"rewards", "truncated", "samples"}},
        samples in slime's `index` order."""
        return self._portal.call(self._evaluate, datasets)

    async def _evaluate(self, datasets: dict[str, EvalDataset]) -> dict[str, dict[str, list]]:
        results = {}
        for name, dataset in datasets.items():
            config = self.engine.config.model_copy(
                update={
                    "n_samples_per_prompt": dataset.n_samples,
                    "max_inflight": max(self.engine.config.max_inflight, dataset.n_samples),
                    "partial_rollout": False,
                    "metrics_port": None,
                    "sampling": replace(
                        dataset.sampling, stop_token_ids=dataset.sampling.stop_token_ids or self.encoder.stop_token_ids
                    ),
                    "limits": replace(
                        self.engine.config.limits,
                        max_tokens=dataset.max_tokens,
                        max_context_len=dataset.max_context_len or self.engine.config.limits.max_context_len,
                    ),
                }
            )
            scoring = SlimeScoring(self._args, self.tokenizer, evaluation=True)
            async with self._engine(config, scoring, dataset.rows) as engine:
                groups = [group async for group in engine.stream()]
            samples = sorted(
                [s for g in groups for s in await scoring.samples_of(g)], key=lambda s: (s.index is None, s.index)
            )
            key = dataset.reward_key
            results[name] = {
                "rewards": [s.reward[key] if key and isinstance(s.reward, dict) else s.reward for s in samples],
                "truncated": [str(s.status.value) == "truncated" for s in samples],
                "samples": samples,
            }
        return results

    # -- weight updates and lifetime -------------------------------------------------------------
    async def _load_new_weights(self, weights_dir: Path) -> None:
        """The embedded model under slime's disk weight path: the newest `weight_vNNNNNN` the trainer wrote
        (by modification time: slime numbers each run's versions from its start, so an earlier run's may have
        higher numbers), if not loaded yet, loaded as SGLang engines would (generation paused, then resumed by
        the step on version NNNNNN). Trajectories paused at the end of the last step go on with these weights."""
        found = max(
            ((mtime, v, p) for v, p in weight_directories(weights_dir) if (mtime := _mtime(p)) is not None),
            default=None,
        )
        if found is None:
            return
        written, version, path = found
        if (path, written) == self._weights_loaded:
            return
        await self.engine.pause()
        await self.backend.update_weights_from_disk(str(path), str(version))  # type: ignore[attr-defined]
        self._weights_loaded = (path, written)
        log.info("the embedded model loaded weight version %d from %s", version, path)

    def pause(self) -> None:
        """Generation stops for a weight update (requests in flight are aborted and keep their tokens)."""
        self._portal.call(self.engine.pause)

    def resume(self, weight_version: str | None = None) -> None:
        """Generation goes on with `weight_version` (default: what the backend reports)."""
        self._portal.call(self.engine.resume, weight_version)

    def status(self) -> dict[str, Any]:
        stats = self._portal.call(_snapshot, self.engine)
        return {
            "weight_version": self.engine.weight_version,
            "groups_open": stats.num_groups_open,
            "groups_done": stats.num_groups_done,
            "groups_returned": stats.num_groups_returned,
            "prompts_queued": len(self._source),
            "trajectories_inflight": stats.num_trajectories_inflight,
            "phases": {str(k): v for k, v in stats.scheduler.phases.items()},
            "metrics_url": self.engine.exporter.url if self.engine.exporter is not None else None,
            "pid": os.getpid(),
            "cpu_seconds": time.process_time(),  # this process's, every thread's
        }

    def shutdown(self) -> None:
        """End the engine (trajectories still held end ABORTED) and its thread."""
        if self._portal is not None:
            try:
                self._portal.call(self._stop.set)
                self._served.result()
            finally:
                self._portal_cm.__exit__(None, None, None)
                self._portal = None


async def _snapshot(engine: RolloutEngine):
    return engine.statistics()


def row_from_group(group: list[Any], rollout_id: int) -> dict[str, Any]:
    """A prompt row for the engine from one group of slime Samples (copies of one prompt). A prompt given
    as text (slime's `--apply-chat-template` renders it so) goes to the model as it is, its images beside
    it; chat messages are rendered by the encoder, their image parts filled from the sample's images."""
    first = group[0]
    images = list((first.multimodal_inputs or {}).get("images") or [])
    prompt = first.prompt
    if isinstance(prompt, list):
        prompt, images = _fill_images(prompt, images), []
    metadata = {**(first.metadata or {}), "start_rollout_id": rollout_id}
    return {"prompt": prompt, "images": images, "label": first.label, "metadata": metadata, "samples": group}


def _fill_images(messages: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """Image parts without image data take the sample's images, in order."""
    if not images:
        return messages
    pending, out = iter(images), []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {**part, "image": next(pending)}
                if isinstance(part, dict) and part.get("type") == "image" and "image" not in part
                else part
                for part in content
            ]
            message = {**message, "content": content}
        out.append(message)
    return out


def _processor(tokenizer: str, *, vision: bool):
    """The VLM processor: the embedded Qwen2.5-VL one when asked for, or the checkpoint's when it has one."""
    from engine.models import load_processor

    if tokenizer == "qwen2.5":
        return load_processor("qwen2.5-vl") if vision else None
    # Hugging Face checkpoints carry preprocessor_config.json; transformers 5 saves processor_config.json
    if any((Path(tokenizer) / name).exists() for name in ("preprocessor_config.json", "processor_config.json")):
        return load_processor(tokenizer)
    return None
