"""Typed configuration, validated once when built.

`EngineConfig` is what `RolloutEngine` runs with; `RunConfig` is `turnstile run`'s, whose YAML files use
the same flat keys as slime's `--custom-config-path` files (`max_turns`, `rollout_interaction_env_path`,
...) plus Turnstile's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from engine.backends.base import SamplingParams
from engine.scheduler.queue import Policy
from engine.scheduler.retry import RetryPolicy
from engine.turn import TurnLimits


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    n_samples_per_prompt: PositiveInt = 1
    max_inflight: PositiveInt = 512  # trajectories admitted and not yet ended
    max_generating: PositiveInt = 256  # concurrent generate requests
    max_env_steps: PositiveInt = 64  # concurrent env steps
    policy: Policy = Policy.GROUP_COMPLETION
    partial_rollout: bool = False
    over_sampling: float = Field(1.0, ge=1.0)
    max_staleness: NonNegativeInt = 1
    on_stale: Literal["restart", "finish"] = "restart"
    mask_offpolicy: bool = False
    drop_zero_std: bool = False  # drop groups whose rewards are all equal (no learning signal)
    limits: TurnLimits = TurnLimits()
    sampling: SamplingParams = SamplingParams(max_new_tokens=1024)  # stop_token_ids default to the encoder's
    retry: RetryPolicy = RetryPolicy()
    breaker_threshold: float = Field(0.5, gt=0, le=1)
    breaker_window_s: float = Field(30.0, gt=0)
    breaker_min_attempts: PositiveInt = 20
    drift_check_every: NonNegativeInt = 0  # re-render 1 finished trajectory in N and count drift (0: never)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # serve Prometheus /metrics here (0: any free port; None: not at all)
    seed: int = 0
    sampling_seed_base: int | None = None  # per-request sampling seed = this + index in group (SGLang)


class BackendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["local", "sglang"] = "local"
    model: str = "tiny-qwen2"  # local: a tiny model name or a saved model's directory
    url: str | None = None  # sglang: the server (or sglang-router) URL; several, comma-separated, form a pool
    timeout: float = 600.0
    max_batch_size: PositiveInt = 64

    @model_validator(mode="after")
    def _url_for_sglang(self) -> BackendConfig:
        if self.kind == "sglang" and not self.url:
            raise ValueError("backend kind 'sglang' needs a url (e.g. http://127.0.0.1:30000)")
        return self


class RunConfig(BaseModel):
    """What `turnstile run` does: which model and env, and the limits of each trajectory."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    tokenizer: str = "qwen2.5"
    chat_template: str | None = None  # Jinja text or a .jinja file replacing the tokenizer's
    vision: bool = False  # a VLM: the Qwen2.5-VL processor, images in prompts and observations
    env_path: str = Field(
        "engine.envs.arith", validation_alias=AliasChoices("env_path", "rollout_interaction_env_path")
    )
    env_step_timeout: float | None = 60.0
    max_turns: PositiveInt = 6
    max_tokens: PositiveInt = 1024  # response budget per trajectory (generated + observation tokens)
    max_new_tokens: PositiveInt = 64  # per turn
    max_context_len: PositiveInt | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    n_samples_per_prompt: PositiveInt = 1
    max_inflight: PositiveInt = 64  # trajectories admitted and not yet ended
    max_generating: PositiveInt = 32  # concurrent generate requests
    max_env_steps: PositiveInt = 16  # concurrent env steps
    policy: Policy = Policy.GROUP_COMPLETION
    retry: RetryPolicy = RetryPolicy()
    metrics_port: int | None = None  # serve Prometheus /metrics on 127.0.0.1:<port> while running
    log_level: Literal["debug", "info", "warning", "error"] = "warning"  # turn and trajectory events
    log_sample: float = Field(1.0, gt=0, le=1)  # share of turn events written
    seed: int = 0
    backend: BackendConfig = BackendConfig()

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> RunConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        return cls.model_validate({**data, **overrides})

    def limits(self) -> TurnLimits:
        return TurnLimits(max_turns=self.max_turns, max_tokens=self.max_tokens, max_context_len=self.max_context_len)

    def sampling(self, stop_token_ids: tuple[int, ...]) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=stop_token_ids,
        )

    def engine(self, stop_token_ids: tuple[int, ...]) -> EngineConfig:
        return EngineConfig(
            n_samples_per_prompt=self.n_samples_per_prompt,
            max_inflight=max(self.max_inflight, self.n_samples_per_prompt),
            max_generating=self.max_generating,
            max_env_steps=self.max_env_steps,
            policy=self.policy,
            limits=self.limits(),
            sampling=self.sampling(stop_token_ids),
            retry=self.retry,
            metrics_port=self.metrics_port,
            seed=self.seed,
        )
