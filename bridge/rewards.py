"""slime's side of a finished trajectory: its Sample, slime's rollout sample hooks, its reward, its filter.

slime's own rollout, after generating a sample, applies `--rollout-sample-hook-path` hooks, then scores
every sample whose reward is still None with `slime.rollout.rm_hub.async_rm(args, sample)` (per-sample
`custom_rm_path`, else `--custom-rm-path`, else the rule of `metadata["rm_type"]` or `--rm-type`), or a
whole group at once with `batched_async_rm` under `--group-rm`; `--dynamic-sampling-filter-path` then
judges each finished group. `SlimeScoring` does the same, as each trajectory (or group) ends, while the
others generate:

    scoring = SlimeScoring(args, tokenizer)              # checks at start what can be honoured here
    engine = RolloutEngine(..., reward_fn=scoring.reward, group_reward_fn=scoring.group_reward (with
                           --group-rm), group_filter=scoring.verdict)
    sample = await scoring.sample_of(trajectory, into)   # its Sample (into the data source's), hooks applied

The env's `info["reward"]` wins where it gives one (the Sample arrives with it, so slime's rule of
scoring only `reward is None` keeps it); `--group-rm` scores every member, as slime does. slime's rm_hub
is imported from slime, which is importable wherever slime calls the bridge. Where it is not (the
embedded default, tests), `--custom-rm-path` (and a sample's own `custom_rm_path`) is still loaded by path
and called as slime calls it, and an `--rm-type` is refused at start.
"""

from __future__ import annotations

import importlib
import inspect
from functools import partial
from typing import Any

import anyio

from bridge.convert import sample_class, settle, to_sample
from engine.engine import Verdict
from engine.envs.loader import caller_sample
from engine.errors import InternalError
from engine.scheduler.scheduler import SCORED
from engine.trajectory import Group, Trajectory


class HookError(ValueError):
    """A slime hook path that does not load; the message names the flag and the path."""


def load_function(path: str, *, flag: str) -> Any:
    """`pkg.module.attr` imported and looked up, as slime's `load_function` does; one clear error if not."""
    module_path, _, attr = path.rpartition(".")
    try:
        function = getattr(importlib.import_module(module_path), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise HookError(f"{flag} {path!r} does not load: {exc!r}") from exc
    if not callable(function):
        raise HookError(f"{flag} {path!r} is not callable")
    return function


def slime_rm_hub() -> Any | None:
    """slime's `slime.rollout.rm_hub` module, or None where slime is not importable."""
    try:
        from slime.rollout import rm_hub
    except ImportError:
        return None
    return rm_hub


class SlimeScoring:
    """slime's hooks, reward and filter for the trajectories of one engine (train or eval)."""

    def __init__(self, args: Any, tokenizer: Any, *, evaluation: bool = False, rollout_id: int | None = None):
        self.args, self.tokenizer, self.evaluation = args, tokenizer, evaluation
        self.rollout_id = rollout_id  # the step being run, for hooks that take `rollout_id` (slime's current one)
        get = lambda name: getattr(args, name, None) if args is not None else None  # noqa: E731
        self.group = bool(get("group_rm")) and not evaluation
        self._hooks = [(path, load_function(path, flag="--rollout-sample-hook-path")) for path in _paths(get)]
        custom = get("custom_rm_path")
        self._custom_rm = load_function(custom, flag="--custom-rm-path") if custom else None
        self._rm_hub = slime_rm_hub()
        rm_type = get("rm_type")
        if rm_type and self._custom_rm is None and self._rm_hub is None:
            raise HookError(
                f"--rm-type {rm_type!r} is slime's reward rule (slime.rollout.rm_hub), which does not import here: "
                "run under slime, or give the reward as a function with --custom-rm-path"
            )
        path = get("dynamic_sampling_filter_path")
        self._filter = load_function(path, flag="--dynamic-sampling-filter-path") if path and not evaluation else None

    @property
    def has_filter(self) -> bool:
        return self._filter is not None

    # -- the Sample ------------------------------------------------------------------------------
    async def sample_of(self, trajectory: Trajectory, into: Any = None) -> Any:
        """The trajectory's Sample (filled into `into`, the data source's own), slime's rollout sample
        hooks applied; made once and kept on the trajectory, its outcome settled on every call."""
        if trajectory.sample is None:
            sample = await self.convert(trajectory, into)
            try:
                sample = await self._apply_hooks(sample)
            except Exception as exc:  # noqa: BLE001 -- a hook's bug fails this trajectory; its group stays whole
                sample = self._failed_sample(trajectory, sample, exc)
            trajectory.sample = sample
        return settle(trajectory.sample, trajectory)

    async def convert(self, trajectory: Trajectory, into: Any = None) -> Any:
        """The trajectory as a Sample, no hooks applied; converted in a worker thread (it decodes and copies
        every token). A conversion that raises fails the trajectory: a Sample with its prompt only."""
        try:
            return await anyio.to_thread.run_sync(partial(to_sample, trajectory, self.tokenizer, into=into))
        except Exception as exc:  # noqa: BLE001 -- the trajectory fails; its group stays whole
            return self._failed_sample(trajectory, into, exc)

    @staticmethod
    def _failed_sample(trajectory: Trajectory, into: Any, exc: Exception) -> Any:
        """A trajectory whose conversion or sample hooks raised: FAILED, with the error recorded, as a
        Sample (`into`, when given) with its prompt and no response (`remove_sample` once settled)."""
        error = InternalError.of(exc, f"converting trajectory {trajectory.id} to a slime Sample").record(
            trajectory.current_turn
        )
        if trajectory.status in SCORED:
            trajectory.fail_after_end(error)
        else:
            trajectory.errors.append(error)
        sample = into if into is not None else sample_class()(group_index=trajectory.group_id, index=trajectory.index)
        sample.prompt = trajectory.prompt if into is None else sample.prompt
        sample.tokens = trajectory.tokens[: trajectory.prompt_length].tolist()
        sample.response, sample.response_length = "", 0
        sample.loss_mask, sample.rollout_log_probs = [], []
        sample.multimodal_train_inputs = None
        return sample

    async def _apply_hooks(self, sample: Any) -> Any:
        """slime's `apply_rollout_sample_hooks` semantics: each hook is `hook(args, sample, **kw)` with the
        keywords it accepts (`evaluation`, `rollout_id`), sync or async; a returned Sample replaces it."""
        kwargs = {"evaluation": self.evaluation, "rollout_id": self.rollout_id}
        for path, hook in self._hooks:
            result = hook(self.args, sample, **_accepted(hook, kwargs))
            if inspect.isawaitable(result):
                result = await result
            if result is not None:
                if not hasattr(result, "response_length"):
                    raise TypeError(f"rollout sample hook {path!r} returned {type(result).__name__}, not a Sample")
                sample = result
        return sample

    # -- rewards ---------------------------------------------------------------------------------
    async def reward(self, trajectory: Trajectory, into: Any = None) -> Any:
        """slime's reward of one ended trajectory: the env's (or a hook's) when there is one, else rm_hub's."""
        sample = await self.sample_of(trajectory, into)
        if sample.reward is None and trajectory.status in SCORED:  # not one that failed to convert
            sample.reward = await self._score(sample)
        return sample.reward

    async def samples_of(self, group: Group) -> list[Any]:
        """The group's Samples (the data source's own, filled), in member order."""
        return [await self.sample_of(t, sample_of_row(group, t)) for t in group.trajectories]

    async def group_reward(self, group: Group) -> list[Any]:
        """`--group-rm`: every member scored at once (a custom function then takes the list)."""
        samples = await self.samples_of(group)
        if self._custom_rm is not None:
            return list(await self._custom_rm(self.args, samples))
        return list(await self._rm().batched_async_rm(self.args, samples))

    async def _score(self, sample: Any) -> Any:
        own = getattr(sample, "custom_rm_path", None)  # an eval dataset's own reward function
        if own and self._rm_hub is None:
            return await load_function(own, flag="custom_rm_path")(self.args, sample)
        if self._custom_rm is not None and self._rm_hub is None:
            return await self._custom_rm(self.args, sample)
        return await self._rm().async_rm(self.args, sample)

    def _rm(self) -> Any:
        if self._rm_hub is None:
            raise HookError(
                "no reward: the env gave none, no --custom-rm-path is set, and slime's rm_hub does not import here"
            )
        return self._rm_hub

    # -- the dynamic sampling filter -------------------------------------------------------------
    async def verdict(self, group: Group) -> Verdict:
        """slime's dynamic sampling filter on the group's Samples: `fn(args, samples)` answering a
        DynamicFilterOutput (keep, reason, keep_when_insufficient) or, as older filters do, a bool."""
        if self._filter is None:
            return Verdict(keep=True)
        output = self._filter(self.args, await self.samples_of(group))
        if not hasattr(output, "keep"):
            return Verdict(keep=bool(output))
        return Verdict(
            keep=bool(output.keep),
            reason=getattr(output, "reason", None),
            keep_when_insufficient=bool(getattr(output, "keep_when_insufficient", False)),
        )


def _paths(get: Any) -> list[str]:
    paths = get("rollout_sample_hook_path") or []
    return [paths] if isinstance(paths, str) else list(paths)


def _accepted(function: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters}
    return {key: value for key, value in kwargs.items() if key in names}


def sample_of_row(group: Group, trajectory: Trajectory) -> Any:
    """The data source's Sample for this member of the group, if the row carries them."""
    return caller_sample(group.row, trajectory.index)
