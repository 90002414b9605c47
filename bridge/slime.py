"""Turnstile as slime's rollout: functions with slime's signatures, loaded by path.

    --rollout-function-path bridge.slime.generate_rollout      (eval too: --eval-function-path defaults to it)
    --custom-generate-function-path bridge.slime.generate       (keep slime's own loop, one sample at a time)
    --custom-config-path turnstile.yaml                          (max_turns, rollout_interaction_env_path, turnstile:)

`generate_rollout` pulls prompt groups from `data_source.get_samples(n)` as it needs them (more with
partial rollout), hands them to the rollout service (bridge/service.py) and returns
`RolloutFnTrainOutput(samples, metrics)`: every group whole, `n_samples_per_prompt` Samples each.
Unfinished trajectories stay in the service, envs and all, for the next call; slime's buffer, which
cannot hold an env, is not used.

The service lives as long as the process: on slime's `args` object (in-process), in a named Ray
actor (`turnstile.ray_actor`), or, for `args=None`, in one embedded-default service per group size
held by this module, with the embedded default's prompts when no data source is given either. These two
module-level holders are the only global state: slime's function-path interface hands over nothing else
that lasts.
"""

from __future__ import annotations

import atexit
import functools
import logging
from typing import Any

from bridge.convert import sample_class
from bridge.evaluation import eval_datasets
from bridge.flags import FlagError, check_args
from bridge.rewards import load_function
from bridge.service import RolloutService
from bridge.settings import BridgeSettings, settings_from_args

# The HTTP client logs each request at INFO, which slime's logging shows: a line per turn. slime quiets its own
# client (httpx) the same way in slime/ray/rollout.py.
logging.getLogger("httpx2").setLevel(logging.WARNING)

try:
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
except ImportError:  # slime is not installed: the same shapes
    from dataclasses import dataclass

    @dataclass
    class RolloutFnTrainOutput:  # type: ignore[no-redef]
        samples: list[list[Any]]
        metrics: dict[str, Any] | None = None

    @dataclass
    class RolloutFnEvalOutput:  # type: ignore[no-redef]
        data: dict[str, dict[str, Any]]
        metrics: dict[str, Any] | None = None


_EMBEDDED: dict[int, RolloutService] = {}  # args=None: one service per group size (see the module docstring)
SERVICE_ATTRIBUTE = "_turnstile_service"


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout function. Train: `RolloutFnTrainOutput`; eval: `RolloutFnEvalOutput`.

    A step, as slime's own: groups are generated, scored as they end and filtered (dropped groups are
    replaced from the data source); then `--rollout-sample-filter-path` runs on the kept groups and
    `--rollout-all-samples-process-path` on kept and dropped ones, both sorted by slime's `index`."""
    if evaluation:
        if _get(args, "group_rm"):
            raise FlagError("--group-rm: slime's eval scores samples one by one (its eval_rollout asserts no group_rm)")
        service = service_for(args, group_size=1)
        return RolloutFnEvalOutput(data=service.evaluate(eval_datasets(args, service.settings)), metrics=None)
    if data_source is None:
        if args is not None:
            raise ValueError(
                "generate_rollout: data_source is None: slime passes its RolloutDataSource; "
                "call it with one, or with args=None and no data source for the embedded default"
            )
        data_source = _embedded_source()
    first = data_source.get_samples(1) if args is None else []  # args=None: learn the group size from the data
    service = service_for(args, group_size=len(first[0]) if first else None)
    target = service.settings.target_groups
    groups = first + _take(data_source, service.wanted(target) - len(first))
    samples: list[list[Any]] = []
    dropped: list[list[Any]] = []
    metrics: dict[str, Any] = {}
    while True:
        out = service.rollout(rollout_id, target - len(samples), groups)
        samples += out.samples
        dropped += out.dropped
        metrics = out.metrics
        if len(samples) >= target:
            break
        groups = _take(data_source, target - len(samples))  # dropped groups are replaced
        if not groups:
            break  # the data source ran dry
    samples.sort(key=_first_index)
    if (path := _get(args, "rollout_sample_filter_path")) is not None:
        load_function(path, flag="--rollout-sample-filter-path")(args, samples)
    if (path := _get(args, "rollout_all_samples_process_path")) is not None:
        every = sorted(samples + dropped, key=_first_index)
        load_function(path, flag="--rollout-all-samples-process-path")(args, every, data_source)
    return RolloutFnTrainOutput(samples=samples, metrics=metrics)


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime's custom generate function: one multi-turn trajectory for `sample`, through the same
    engine (slots, retries, metrics) as `generate_rollout`. Returns the Sample, filled."""
    return await service_for(args, group_size=1).agenerate(sample, sampling_params)


class EmbeddedSource:
    """The embedded default's data source, in slime's shape: `get_samples(n)` gives n groups of
    `n_samples_per_prompt` Samples of one prompt each, from the built-in arithmetic env's own prompts."""

    def __init__(self, n_samples_per_prompt: int = 4, seed: int = 0):
        from engine.envs import arith

        self.n_samples_per_prompt, self.seed, self._make_prompts = n_samples_per_prompt, seed, arith.make_prompts
        self._next = 0

    def get_samples(self, num: int) -> list[list[Any]]:
        sample = sample_class()
        rows = self._make_prompts(self._next + num, seed=self.seed)[self._next :]
        groups = []
        for group_index, row in enumerate(rows, start=self._next):
            first = group_index * self.n_samples_per_prompt
            groups.append(
                [
                    sample(
                        group_index=group_index,
                        index=first + i,
                        prompt=row["prompt"],
                        label=row.get("label"),
                        metadata=dict(row.get("metadata") or {}),
                    )
                    for i in range(self.n_samples_per_prompt)
                ]
            )
        self._next += num
        return groups


@functools.cache
def _embedded_source() -> EmbeddedSource:
    """args=None and no data source: one source for the process, so each step takes the next prompts."""
    return EmbeddedSource()


def service_for(args: Any, *, group_size: int | None) -> RolloutService:
    """The service for these args: held on `args`, in a Ray actor, on shards in Ray actors, or the embedded
    default."""
    if args is None:
        n = group_size or 1
        if n not in _EMBEDDED:
            _EMBEDDED[n] = _keep(RolloutService(BridgeSettings.embedded(n)))
        return _EMBEDDED[n]
    service = getattr(args, SERVICE_ATTRIBUTE, None)
    if service is None:
        check_args(args)
        settings = settings_from_args(args)
        if settings.shards > 1:
            from bridge.shards import ray_shards

            service = ray_shards(settings, args)
        elif settings.ray_actor:
            from bridge.ray_actor import attach_or_create

            service = attach_or_create(settings.ray_actor, settings, args)
        else:
            service = _keep(RolloutService(settings, env_args=args))
        setattr(args, SERVICE_ATTRIBUTE, service)
    return service


def _get(args: Any, name: str) -> Any:
    return getattr(args, name, None) if args is not None else None


def _first_index(group: list[Any]) -> Any:
    index = group[0].index
    return (index is None, index)


def _take(data_source: Any, n: int) -> list[list[Any]]:
    return data_source.get_samples(n) if n > 0 else []


def _keep(service: RolloutService) -> RolloutService:
    atexit.register(service.shutdown)
    return service
