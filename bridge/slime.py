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
held by this module. That module-level holder is the one piece of global state: slime's function-path
interface hands over nothing else that lasts.
"""

from __future__ import annotations

import atexit
import json
from pathlib import Path
from typing import Any

from bridge.convert import sample_class
from bridge.service import RolloutService, row_from_group
from bridge.settings import BridgeSettings, settings_from_args

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
    """slime's rollout function. Train: `RolloutFnTrainOutput`; eval: `RolloutFnEvalOutput`."""
    if evaluation:
        service = service_for(args, group_size=1)
        return RolloutFnEvalOutput(data=service.evaluate(eval_datasets(args, service.settings)), metrics=None)
    first = data_source.get_samples(1) if args is None else []  # args=None: learn the group size from the data
    service = service_for(args, group_size=len(first[0]) if first else None)
    target = service.settings.target_groups
    groups = first + _take(data_source, service.wanted(target) - len(first))
    samples: list[list[Any]] = []
    metrics: dict[str, Any] = {}
    while True:
        out = service.rollout(rollout_id, target - len(samples), groups)
        samples += out.samples
        metrics = out.metrics
        if len(samples) >= target:
            break
        groups = _take(data_source, target - len(samples))  # filtered groups are replaced
        if not groups:
            break  # the data source ran dry
    return RolloutFnTrainOutput(samples=samples, metrics=metrics)


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime's custom generate function: one multi-turn trajectory for `sample`, through the same
    engine (slots, retries, metrics) as `generate_rollout`. Returns the Sample, filled."""
    return await service_for(args, group_size=1).agenerate(sample, sampling_params)


def service_for(args: Any, *, group_size: int | None) -> RolloutService:
    """The service for these args: held on `args`, in a Ray actor, or the embedded default."""
    if args is None:
        n = group_size or 1
        if n not in _EMBEDDED:
            _EMBEDDED[n] = _keep(RolloutService(BridgeSettings.embedded(n)))
        return _EMBEDDED[n]
    service = getattr(args, SERVICE_ATTRIBUTE, None)
    if service is None:
        settings = settings_from_args(args)
        if settings.turnstile.ray_actor:
            from bridge.ray_actor import attach_or_create

            service = attach_or_create(settings.turnstile.ray_actor, settings, args)
        else:
            service = _keep(RolloutService(settings, env_args=args))
        setattr(args, SERVICE_ATTRIBUTE, service)
    return service


def eval_datasets(args: Any, settings: BridgeSettings) -> dict[str, tuple[list[dict[str, Any]], int]]:
    """slime's `args.eval_datasets` as prompt rows; the built-in env's prompts when there are none."""
    configs = getattr(args, "eval_datasets", None) if args is not None else None
    if not configs:
        from engine.envs.arith import make_prompts

        return {"arith": (make_prompts(4, seed=1_000, vision=settings.turnstile.vision), 1)}
    datasets = {}
    default_n = getattr(args, "n_samples_per_eval_prompt", None) or 1
    for cfg in configs:
        rows = [_eval_row(row, cfg, settings) for row in _raw_rows(cfg.path)]
        datasets[cfg.name] = (rows, cfg.n_samples_per_eval_prompt or default_n)
    return datasets


def _eval_row(raw: dict[str, Any], cfg: Any, settings: BridgeSettings) -> dict[str, Any]:
    Sample = sample_class()
    prompt = raw[cfg.input_key or "prompt"]
    sample = Sample(
        prompt=prompt,
        label=raw.get(cfg.label_key or "label"),
        metadata=dict(raw.get(cfg.metadata_key or "metadata") or {}),
    )
    return row_from_group([sample], rollout_id=-1, settings=settings)


def _raw_rows(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _take(data_source: Any, n: int) -> list[list[Any]]:
    return data_source.get_samples(n) if n > 0 else []


def _keep(service: RolloutService) -> RolloutService:
    atexit.register(service.shutdown)
    return service
