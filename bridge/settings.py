"""slime's `args`, read once, into Turnstile's settings. Nothing below the bridge sees `args`.

slime's own flags are read where they apply (`n_samples_per_prompt`, `rollout_batch_size`,
`over_sampling_batch_size`, `partial_rollout`, `mask_offpolicy_in_partial_rollout`,
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
      max_generating: 256        # concurrent generate requests
      max_env_steps: 64          # concurrent env steps
      policy: oldest             # fifo | group_completion | oldest
      over_sampling: 1.75        # with --partial-rollout (default: over_sampling_batch_size / rollout_batch_size)
      max_staleness: 1
      max_new_tokens: 1024       # a per-turn cap (default: none; a turn may use what is left of the budget)
      retry: {per_trajectory: 8, env_step_timeout_s: 120}
      metrics_port: 9400         # Prometheus /metrics on metrics_host (default 127.0.0.1)
      ray_actor: turnstile-rollout   # host the engine in this named Ray actor (default: in the rollout process)

With `args=None`, or an `args` without these, the bridge runs the embedded default: the tiny local
model, the Qwen tokenizer and the built-in arithmetic env.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from engine.backends.base import SamplingParams
from engine.config import EngineConfig
from engine.scheduler.queue import Policy
from engine.scheduler.retry import RetryPolicy
from engine.turn import TurnLimits

EMBEDDED_TARGET_GROUPS = 2  # groups per step when slime's args do not say
EMBEDDED_TURN_TOKENS = 48  # the tiny local model's per-turn cap (it seldom stops by itself; no server given)
DEFAULT_MAX_GENERATING = 256  # concurrent generate requests, when neither slime's args nor turnstile: say


class TurnstileSection(BaseModel):
    """The `turnstile:` mapping of slime's custom config YAML."""

    model_config = ConfigDict(extra="forbid")

    max_generating: PositiveInt | None = None  # default: slime's sglang_server_concurrency x engines
    max_env_steps: PositiveInt = 64
    max_inflight: PositiveInt | None = None
    policy: Policy = Policy.GROUP_COMPLETION
    over_sampling: float | None = Field(None, ge=1.0)
    max_staleness: int = Field(1, ge=0)
    on_stale: Literal["restart", "finish"] = "restart"
    drop_zero_std: bool = False
    max_new_tokens: PositiveInt | None = None
    env_step_timeout_s: float | None = Field(None, gt=0)
    retry: RetryPolicy = RetryPolicy()
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    vision: bool = False  # the embedded default's VLM (tiny Qwen2.5-VL, images in observations)
    model: str = "tiny-qwen2"  # the embedded default's model, when no SGLang router is given
    ray_actor: str | None = None


class BridgeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    n_samples_per_prompt: PositiveInt = 1
    target_groups: PositiveInt = EMBEDDED_TARGET_GROUPS
    partial_rollout: bool = False
    mask_offpolicy: bool = False
    over_sampling: float = 1.0
    max_turns: PositiveInt = 6
    env_path: str = "engine.envs.arith"
    tokenizer: str = "qwen2.5"  # a Hugging Face tokenizer directory, or the embedded "qwen2.5"
    chat_template_kwargs: dict[str, Any] = {}  # slime's --apply-chat-template-kwargs, for every observation too
    url: str | None = None  # SGLang router (or one server); None: the embedded local backend
    max_tokens: PositiveInt = 2048  # response budget of a trajectory (slime's rollout_max_response_len)
    max_context_len: PositiveInt | None = None
    sampling: SamplingParams = SamplingParams(max_new_tokens=2048)  # max_new_tokens: the per-turn cap
    sampling_seed_base: int | None = None  # slime's rollout_seed, with --sglang-enable-deterministic-inference
    max_generating: PositiveInt | None = None  # slime's sglang_server_concurrency x engines, unless turnstile: says
    num_gpus: int | None = None
    turnstile: TurnstileSection = TurnstileSection()

    @classmethod
    def embedded(cls, n_samples_per_prompt: int) -> BridgeSettings:
        """The embedded default, for `args=None`: small steps of short turns with the tiny local model."""
        return cls(
            n_samples_per_prompt=n_samples_per_prompt,
            max_turns=4,
            max_tokens=512,
            sampling=SamplingParams(max_new_tokens=EMBEDDED_TURN_TOKENS),
        )

    def engine_config(self, stop_token_ids: tuple[int, ...]) -> EngineConfig:
        t = self.turnstile
        per_group = self.n_samples_per_prompt
        groups_in_flight = math.ceil(self.target_groups * (self.over_sampling if self.partial_rollout else 1.0))
        return EngineConfig(
            n_samples_per_prompt=per_group,
            max_inflight=t.max_inflight or max(groups_in_flight * per_group, per_group),
            max_generating=t.max_generating or self.max_generating or DEFAULT_MAX_GENERATING,
            max_env_steps=t.max_env_steps,
            policy=t.policy,
            partial_rollout=self.partial_rollout,
            over_sampling=self.over_sampling,
            max_staleness=t.max_staleness,
            on_stale=t.on_stale,
            mask_offpolicy=self.mask_offpolicy,
            drop_zero_std=t.drop_zero_std,
            limits=TurnLimits(
                max_turns=self.max_turns, max_tokens=self.max_tokens, max_context_len=self.max_context_len
            ),
            sampling=replace(self.sampling, stop_token_ids=self.sampling.stop_token_ids or stop_token_ids),
            sampling_seed_base=self.sampling_seed_base,
            retry=t.retry
            if t.env_step_timeout_s is None
            else t.retry.model_copy(update={"env_step_timeout_s": t.env_step_timeout_s}),
            metrics_port=t.metrics_port,
            metrics_host=t.metrics_host,
        )


def settings_from_args(args: Any) -> BridgeSettings:
    """Read slime's `args` (any object with attributes, or None) once. Where an attribute is missing,
    slime's own default applies (a slime run always has them all)."""
    get = lambda name, default=None: getattr(args, name, default) if args is not None else default  # noqa: E731
    section = TurnstileSection.model_validate(get("turnstile") or {})
    target = get("rollout_batch_size") or EMBEDDED_TARGET_GROUPS
    over_sampling = section.over_sampling or max(1.0, (get("over_sampling_batch_size") or target) / target)
    response_len = get("rollout_max_response_len") or 2048
    router_ip, router_port = get("sglang_router_ip"), get("sglang_router_port")
    temperature, top_k = get("rollout_temperature"), get("rollout_top_k")
    url = f"http://{router_ip}:{router_port}" if router_ip and router_port else None
    sampling = SamplingParams(
        # a turn may use what is left of the response budget; a per-turn cap only when asked for (or on the
        # embedded tiny model, whose random weights would otherwise fill the budget in one turn)
        max_new_tokens=section.max_new_tokens or (response_len if url else min(response_len, EMBEDDED_TURN_TOKENS)),
        temperature=1.0 if temperature is None else temperature,
        top_p=get("rollout_top_p") or 1.0,
        top_k=-1 if top_k is None else top_k,
        stop_token_ids=tuple(get("rollout_stop_token_ids") or ()),
        stop=tuple(get("rollout_stop") or ()),
        skip_special_tokens=bool(get("rollout_skip_special_tokens", False)),
    )
    deterministic = bool(get("sglang_enable_deterministic_inference", False))
    concurrency = get("sglang_server_concurrency")
    return BridgeSettings(
        n_samples_per_prompt=get("n_samples_per_prompt") or 1,
        target_groups=target,
        partial_rollout=bool(get("partial_rollout", False)),
        mask_offpolicy=bool(get("mask_offpolicy_in_partial_rollout", False)),
        over_sampling=over_sampling,
        max_turns=get("max_turns") or 6,
        env_path=get("rollout_interaction_env_path") or "engine.envs.arith",
        tokenizer=get("hf_checkpoint") or "qwen2.5",
        chat_template_kwargs=dict(get("apply_chat_template_kwargs") or {}),
        url=url,
        max_tokens=response_len,
        max_context_len=get("rollout_max_context_len"),
        sampling=sampling,
        sampling_seed_base=(get("rollout_seed") if get("rollout_seed") is not None else 42) if deterministic else None,
        max_generating=concurrency * max(1, _num_engines(get)) if concurrency else None,
        num_gpus=get("rollout_num_gpus"),
        turnstile=section,
    )


def _num_engines(get: Any) -> int:
    """SGLang engines behind the router, as slime counts them (`get_rollout_num_engines`)."""
    if get("rollout_num_engines") is not None:
        return int(get("rollout_num_engines"))
    gpus = get("rollout_num_gpus") or 0
    return gpus // (get("rollout_num_gpus_per_engine") or 1) if gpus > 0 else 0
