"""slime's `args`, read once, into Turnstile's settings. Nothing below the bridge sees `args`.

The settings are engine.config's one model (`Settings`; docs/settings.md lists every knob, its default
and where it comes from under slime). slime's own flags are read where they apply (`n_samples_per_prompt`,
`rollout_batch_size`, `over_sampling_batch_size`, `partial_rollout`, `mask_offpolicy_in_partial_rollout`,
`rollout_max_response_len`, `rollout_max_context_len`, `rollout_temperature` / `top_p` / `top_k`,
`rollout_stop`, `rollout_stop_token_ids`, `rollout_skip_special_tokens`, `rollout_seed` with
`sglang_enable_deterministic_inference`, `hf_checkpoint`, `apply_chat_template_kwargs`,
`sglang_router_ip` / `port`, `sglang_server_concurrency`, `rollout_num_gpus`; bridge/flags.py lists
every rollout flag and what becomes of it), as are the keys slime's multi-turn examples put in `--custom-config-path`
(`max_turns`, `rollout_interaction_env_path`). Turnstile's own settings come from a `turnstile:`
mapping in the same YAML (it lands on `args.turnstile`):

    max_turns: 6
    rollout_interaction_env_path: my_pkg.env_geo3k
    turnstile:
      max_generating: 256        # concurrent generate requests (default: sglang_server_concurrency x engines)
      max_env_steps: 64          # concurrent env steps
      policy: oldest             # fifo | group_completion | oldest
      over_sampling: 1.75        # with --partial-rollout (default: over_sampling_batch_size / rollout_batch_size)
      max_staleness: 1
      max_new_tokens: 1024       # a per-turn cap (default: none; a turn may use what is left of the budget)
      retry: {per_trajectory: 8, env_step_timeout_s: 120}
      metrics_port: 9400         # Prometheus /metrics on metrics_host (default 127.0.0.1)
      ray_actor: turnstile-rollout   # host the engine in this named Ray actor (default: in the rollout process)

The section takes the knobs of the model by name. A knob that slime's flags decide (the temperature,
the response budget, ...) is refused there, naming the flag to set instead, as is any key that is not
a knob; slime's flags thus keep priority. For the few knobs slime only suggests (`max_generating`,
`over_sampling`, `max_inflight`), the section's value wins and slime's args fill them when it is silent.

With `args=None`, or an `args` without these, the bridge runs the embedded default: the tiny local
model, the Qwen tokenizer and the built-in arithmetic env.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from bridge.flags import slime_starts_no_engines, weights_by_disk
from engine.config import EMBEDDED_TURN_TOKENS, Settings, Slime, checked, marker, problems

__all__ = [
    "DEFAULT_MAX_GENERATING",
    "EMBEDDED_TARGET_GROUPS",
    "EMBEDDED_TURN_TOKENS",
    "BridgeSettings",
    "section",
    "settings_from_args",
]

EMBEDDED_TARGET_GROUPS = Settings.model_fields["target_groups"].default  # groups per step when slime's args do not say
DEFAULT_MAX_GENERATING = Settings.model_fields["max_generating"].default  # when neither slime's args nor turnstile: say


class BridgeSettings(Settings):
    """The settings as the slime bridge runs with them (`settings_from_args`). No URL means the embedded
    local backend, whose turns are capped at `EMBEDDED_TURN_TOKENS` unless `max_new_tokens` is set."""

    @classmethod
    def embedded(cls, n_samples_per_prompt: int) -> BridgeSettings:
        """The embedded default, for `args=None`: small steps of short turns with the tiny local model."""
        return cls(n_samples_per_prompt=n_samples_per_prompt, max_turns=4, max_tokens=512)


def section(values: Any) -> dict[str, Any]:
    """slime's `args.turnstile`, every key checked against the settings' knobs: one ValueError names the
    first key that is not a knob, or that slime's flags decide (and which flag that is)."""
    return checked(values or {}, BridgeSettings, "slime", where="turnstile", key_prefix="turnstile.")


def settings_from_args(args: Any) -> BridgeSettings:
    """Read slime's `args` (any object with attributes, or None) once. Where an attribute is missing,
    slime's own default applies (a slime run always has them all), else the knob's default."""
    get = lambda name, default=None: getattr(args, name, default) if args is not None else default  # noqa: E731
    own = section(get("turnstile"))
    router_ip, router_port = get("sglang_router_ip"), get("sglang_router_port")
    engines = not slime_starts_no_engines(args)  # with none, slime's router has no workers: the embedded model
    url = f"http://{router_ip}:{router_port}" if router_ip and router_port and engines else None
    deterministic = bool(get("sglang_enable_deterministic_inference", False))
    seed = get("rollout_seed")
    from_slime = {  # what slime's flags decide; None: the knob's default
        "n_samples_per_prompt": get("n_samples_per_prompt"),
        "target_groups": get("rollout_batch_size"),
        "partial_rollout": bool(get("partial_rollout", False)),
        "mask_offpolicy": bool(get("mask_offpolicy_in_partial_rollout", False)),
        "max_turns": get("max_turns"),
        "env_path": get("rollout_interaction_env_path"),
        "tokenizer": get("hf_checkpoint"),
        "chat_template_kwargs": get("apply_chat_template_kwargs"),  # the model checks each value's type
        "model_family": get("sglang_tool_call_parser"),
        "reasoning_parser": get("sglang_reasoning_parser"),
        "url": url,
        "backend": "sglang" if url else None,
        "max_tokens": get("rollout_max_response_len"),
        "max_context_len": get("rollout_max_context_len"),
        "temperature": get("rollout_temperature"),
        "top_p": get("rollout_top_p"),
        "top_k": get("rollout_top_k"),
        "stop": get("rollout_stop"),
        "stop_token_ids": get("rollout_stop_token_ids"),
        "skip_special_tokens": bool(get("rollout_skip_special_tokens", False)),
        "sampling_seed_base": (seed if seed is not None else 42) if deterministic else None,
        "num_gpus": get("rollout_num_gpus"),
        "router_policy": get("router_policy"),
        "model": get("hf_checkpoint") if not engines else None,  # the model slime trains generates
        "weights_dir": get("update_weight_disk_dir") if not engines and weights_by_disk(args) else None,
    }
    values = {key: value for key, value in from_slime.items() if value is not None}
    values.update(_filled(get, own, values))
    try:
        return BridgeSettings.model_validate({**values, **own})
    except ValidationError as exc:  # one error naming each bad value by where it came from
        raise ValueError(problems(exc, lambda knob: _source(knob, own))) from exc


def _source(knob: str, own: dict[str, Any]) -> str:
    """Where a knob's value came from: the `turnstile:` section, or slime's flag (the knob's name too)."""
    field = BridgeSettings.model_fields.get(knob)
    slime = marker(field, Slime) if field is not None and knob not in own else None
    return f"turnstile.{knob}" if slime is None else f"slime's {slime.source} ({knob})"


def _filled(get: Any, own: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """What slime's args suggest for the knobs the section leaves unset: over_sampling from
    over_sampling_batch_size, max_generating from sglang_server_concurrency, max_inflight from the
    groups a step keeps in flight."""
    target = values.get("target_groups", EMBEDDED_TARGET_GROUPS)
    per_group = values.get("n_samples_per_prompt", 1)
    over_sampling = own.get("over_sampling") or max(1.0, (get("over_sampling_batch_size") or target) / target)
    in_flight = math.ceil(target * (over_sampling if values["partial_rollout"] else 1.0))
    filled: dict[str, Any] = {"over_sampling": over_sampling, "max_inflight": max(in_flight * per_group, per_group)}
    concurrency = get("sglang_server_concurrency")
    if concurrency:
        filled["max_generating"] = concurrency * max(1, _num_engines(get))
    return filled


def _num_engines(get: Any) -> int:
    """SGLang engines behind the router, as slime counts them (`get_rollout_num_engines`)."""
    if get("rollout_num_engines") is not None:
        return int(get("rollout_num_engines"))
    gpus = get("rollout_num_gpus") or 0
    return gpus // (get("rollout_num_gpus_per_engine") or 1) if gpus > 0 else 0
